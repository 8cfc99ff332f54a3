"""What the engine hands back for each request (mirrors vLLM's `RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.sequence import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``): ``rank`` is its
    1-based place in the whole distribution (1: the most likely), ``decoded_token`` its
    text on its own."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's names: one dict per position, token id -> Logprob; the sampled (or prompt) token
# first, then the top-k in rank order. A prompt's first position has nothing before it.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """The generated part of one request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None: running
    stop_reason: str | int | None = None  # the stop string or stop token id that fired
    logprobs: SampleLogprobs | None = None  # one dict per token id, if the request asked
    cumulative_logprob: float | None = None  # beam search: the sum of its tokens' logprobs

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
    prompt_logprobs: PromptLogprobs | None = None  # if the request asked (DELTA: once)
    error: str | None = None  # finish_reason "error": what went wrong


@dataclass
class ModelRunnerOutput:
    """What one executed step hands back to the engine (vLLM's ``ModelRunnerOutput``):
    the tokens sampled for each request that sampled. A list per request, since a step
    may produce several tokens for one request (speculative decoding does).

    For requests that asked (``logprobs``, ``prompt_logprobs``): a dict per sampled token,
    and per prompt row of the step's chunk, from its ``prompt_logprobs_start``-th prompt
    token on (``decoded_token`` is left to the output processor, which has the tokenizer)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, SampleLogprobs]] = field(default_factory=dict)
