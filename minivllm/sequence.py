"""The state of one request as it moves through the engine.

The one number that drives everything is ``num_computed_tokens``: how many of the
request's known tokens (prompt + generated so far) already have their keys and values in
the KV cache. Each step the scheduler lets it catch up by some tokens (a prefill chunk,
or the single newest token for a decode); when it catches up completely, the model's
output at the last position is sampled and one more token becomes known.

Invariant: ``num_computed_tokens <= num_tokens``, and the block table holds exactly
``ceil(num_computed_tokens / block_size)`` blocks between steps.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks taken back; waits to be recomputed from scratch
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # it failed inside a step (vLLM's): it alone, the others go on


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) of one request's life, and the
    latencies vLLM reports, derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Arrival until first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival until the first output token exists."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (output tokens - 1)."""
        if self.finished_time is None or self.ttft is None or len(self.token_times) < 2:
            return None
        return (self.e2e_latency - self.ttft) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class Sequence:
    """One request: its tokens, how far the KV cache has caught up, and its blocks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        # Its own copy, kept: every streamed output hands it out (vLLM's too), and slicing
        # it from token_ids each step would cost the whole prompt, per request, per step.
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        # Async scheduling: tokens sampled by steps already scheduled but not processed yet
        # (vLLM's ``num_output_placeholders``); they count as known but have no id yet.
        self.num_output_placeholders = 0
        self.block_table: list[int] = []
        # Which table this is: the KV cache manager gives a fresh id whenever it starts one
        # (admission, readmission after preemption) or cuts one short (rejected drafts), so
        # the runner's persistent batch knows a table it holds is no longer this one.
        self.block_table_id = 0
        # The table as of the last snapshot, and which table and length it was taken at.
        self._snapshot: tuple[int, ...] = ()
        self._snapshot_key = (0, 0)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that fired
        self.sampling_params = sampling_params
        self.generator = generator  # this request's own RNG: sampling ignores batch-mates
        # A child of an ``n > 1`` request: shares its siblings' prompt blocks through the
        # prefix cache even when prefix caching is off (parallel_sampling.py).
        self.shares_prompt = False
        now = time.perf_counter()
        self.metrics = RequestMetrics(arrival_time=now if arrival_time is None else arrival_time)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    def block_table_snapshot(self) -> tuple[int, ...]:
        """The block table now, as an immutable tuple for a step's record
        (scheduler_output.py). Taken again only when the table changed: the KV cache manager
        only appends to a table it handed out and gives it a new ``block_table_id`` for
        anything else (the contract input_batch.py relies on too), so the id and the length
        name the contents. A decode that stays in its last block shares last step's tuple,
        instead of copying a table that grows with the context, per request, per step."""
        key = (self.block_table_id, len(self.block_table))
        if key != self._snapshot_key or not self.block_table_id:  # id 0: set by hand, no id
            self._snapshot, self._snapshot_key = tuple(self.block_table), key
        return self._snapshot

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose keys/values are not in the cache yet: what a step can schedule."""
        return len(self.token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (the prompt, or a recompute), as opposed
        to a decode: computing the one token it sampled last step. (A prompt's last chunk
        may be a single token and is still prefill.)"""
        has_sampled = self.num_output_tokens + self.num_output_placeholders > 0
        return not (has_sampled and self.num_uncomputed_tokens == 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)

    def finish(
        self, reason: FinishReason, now: float, stop_reason: str | int | None = None
    ) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = now
