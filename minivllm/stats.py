"""One snapshot per engine step (vLLM's ``IterationStats`` and ``SchedulerStats`` in one):
what the step ran (prefill, decode and padding token rows, who was preempted), the
requests it advanced (prompt tokens of prefills that completed, output tokens kept), and
the engine's state after it (queues, KV blocks, the prefix-cache and spec-decode totals).

`EngineStats` builds one after every step that ran (``engine.last_stats``; between
`engine.record_steps()` and `engine.take_step_stats()`, every one); `LLMEngine.stats()`
reads one built between steps. The bench summarizes a run's snapshots
(`minivllm.bench.metrics`), the server's ``/metrics`` (`minivllm.entrypoints.prometheus`)
and live page read each one as it comes.
Per-request latencies come from `RequestMetrics` (sequence.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from minivllm.kv_cache_manager import KVCacheManager, PrefixCacheStats

if TYPE_CHECKING:
    from minivllm.scheduler_interface import SchedulerInterface
    from minivllm.scheduler_output import SchedulerOutput
    from minivllm.sequence import Sequence
    from minivllm.spec_decode import SpecDecodingStats


@dataclass
class StepStats:
    """One engine step; counts of sequences and blocks are taken after the step."""

    start_time: float
    end_time: float
    num_prefill_tokens: int  # token rows: prompt chunks (and recomputation after preemption)
    num_decode_tokens: int
    num_padding_tokens: int  # rows computed and thrown away (static batching)
    num_running: int  # sequences holding KV (static: the whole batch, finished included)
    num_waiting: int  # never scheduled yet
    num_preempted: int  # waiting to be recomputed
    num_kv_blocks_used: int
    num_kv_tokens_stored: int  # real tokens whose keys/values those blocks hold
    prefill_ids: list[str] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    padding_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # preempted in this step
    # Counted per request, once each (vLLM's IterationStats): the whole prompt, cached
    # tokens included, of each request whose first output token came this step (so never
    # again after a preemption); and the output tokens the requests kept this step.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Since the engine started (the prefix cache's since its last reset).
    num_kv_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off

    @classmethod
    def capture(
        cls,
        scheduler: SchedulerInterface,
        kv_cache_manager: KVCacheManager,
        spec_decoding: SpecDecodingStats | None,
        scheduled: SchedulerOutput | None = None,
        start_time: float = 0.0,
        end_time: float = 0.0,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
    ) -> StepStats:
        """The state of ``scheduler`` and ``kv_cache_manager`` now, and what the step
        ``scheduled`` ran (None: between steps, nothing ran). Rows that advanced no
        request are static batching's padding. Nothing here scans the waiting queue: the
        scheduler keeps its count of preempted requests as they come and go."""
        kv = kv_cache_manager
        num_preempted = scheduler.num_waiting_preempted
        return cls(
            start_time=start_time,
            end_time=end_time,
            **_what_ran(scheduled),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) - num_preempted,
            num_preempted=num_preempted,
            num_kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            num_kv_tokens_stored=sum(s.num_computed_tokens for s in scheduler.running),
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            num_kv_blocks=kv.num_blocks,
            num_preemptions_total=scheduler.num_preemptions,
            prefix_cache=replace(kv.prefix_cache_stats),
            spec_decoding=None if spec_decoding is None else spec_decoding.copy(),
        )

    @property
    def num_computed_slots(self) -> int:
        """Token rows the model ran on this step, padding included."""
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0


def _what_ran(scheduled: SchedulerOutput | None) -> dict:
    if scheduled is None:
        return dict(num_prefill_tokens=0, num_decode_tokens=0, num_padding_tokens=0)
    return dict(
        num_prefill_tokens=scheduled.num_prefill_tokens,
        num_decode_tokens=scheduled.num_decode_tokens,
        num_padding_tokens=scheduled.num_wasted_tokens,
        prefill_ids=scheduled.prefill_ids,
        decode_ids=scheduled.decode_ids,
        padding_ids=scheduled.wasted_ids,
        preempted_ids=[s.request_id for s in scheduled.preempted],
    )


@dataclass
class TokenCounts:
    """What one step's outputs advanced, counted per request once (vLLM's
    ``IterationStats``): the prompts of requests whose first output token came, and the
    output tokens kept."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    def add(self, seq: Sequence, num_kept: int) -> None:
        """``seq`` kept ``num_kept`` new output tokens (a stop drops the ones after it)."""
        if num_kept and seq.num_output_tokens == num_kept:  # its prefill is complete
            self.num_prompt_tokens += seq.num_prompt_tokens
        self.num_generation_tokens += num_kept


class EngineStats:
    """The engine's statistics: a `StepStats` after every step that ran (``last``), every
    one of them while recording, and a snapshot between steps (vLLM's
    ``Scheduler.make_stats`` and its stat loggers)."""

    def __init__(self, scheduler: SchedulerInterface, kv_cache_manager: KVCacheManager, clock):
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.last: StepStats | None = None  # the last step's snapshot, if it ran
        self.recorded: list[StepStats] | None = None  # a list while recording

    @property
    def spec_decoding(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters since the engine started, or None when it is off
        (the policy that drafts keeps them: spec_decode/scheduler.py)."""
        return getattr(self.scheduler, "spec_decoding_stats", None)

    def make_stats(
        self,
        scheduled: SchedulerOutput | None = None,
        start_time: float | None = None,
        counts: TokenCounts | None = None,
    ) -> StepStats:
        """After a step: what ``scheduled`` ran from ``start_time`` to now; with no step,
        the queues, KV pool and counters as they are now."""
        now = self.clock()
        counts = counts or TokenCounts()
        return StepStats.capture(
            self.scheduler, self.kv_cache_manager, self.spec_decoding, scheduled,
            now if start_time is None else start_time, now,
            counts.num_prompt_tokens, counts.num_generation_tokens,
        )  # fmt: skip

    def step_done(self, scheduled: SchedulerOutput, start_time: float, counts: TokenCounts):
        self.last = self.make_stats(scheduled, start_time, counts)
        if self.recorded is not None:
            self.recorded.append(self.last)

    def record_steps(self) -> None:
        """Keep every step's snapshot from now on, until `take_step_stats`."""
        self.recorded = []

    def take_step_stats(self) -> list[StepStats]:
        """The snapshots kept since `record_steps` (oldest first); recording stops."""
        recorded, self.recorded = self.recorded, None
        if recorded is None:
            raise RuntimeError("take_step_stats() without record_steps() first")
        return recorded

    def as_dict(self, config) -> dict:
        """`make_stats` now, as a dict, with the config, e.g. for a progress display."""
        stats = self.make_stats()
        spec_decode = stats.spec_decoding
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_preempted": stats.num_preempted,
            "num_free_blocks": stats.num_kv_blocks - stats.num_kv_blocks_used,
            "num_kv_blocks": stats.num_kv_blocks,
            "num_preemptions_total": stats.num_preemptions_total,
            # Prefix caching: tokens looked up at each admission (a readmission after a
            # preemption too), and of those, found in the cache instead of computed.
            "prefix_cache_query_tokens": stats.prefix_cache.num_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache.num_hit_tokens,
            "prefix_cache_hit_rate": stats.prefix_cache.hit_rate,
            # Speculative decoding: vLLM's counters and derived rates, when it is on.
            **(spec_decode.as_dict() if spec_decode is not None else {}),
            "config": asdict(config),
        }
