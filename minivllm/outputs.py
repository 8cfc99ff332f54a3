"""What the engine hands back for each request (mirrors vLLM's `RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    """The generated part of one request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that fired

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache, not computed


@dataclass
class ModelRunnerOutput:
    """What one executed step hands back to the engine (vLLM's ``ModelRunnerOutput``):
    the tokens sampled for each request that sampled. A list per request, since a step
    may produce several tokens for one request (speculative decoding does)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
