"""One snapshot per engine step (vLLM's ``IterationStats`` and ``SchedulerStats`` in one):
what the step ran (prefill, decode and padding token rows, who was preempted), the
requests it advanced (prompt tokens of prefills that completed, output tokens kept), and
the engine's state after it (queues, KV blocks, the prefix-cache and spec-decode totals).

`LLMEngine.step` builds one after every step that ran (``engine.last_stats``, and in
``engine.step_log`` when that is a list); `LLMEngine.stats()` reads one built between
steps. The bench summarizes a run's snapshots (`minivllm.bench.metrics`), the server's
``/metrics`` (`minivllm.entrypoints.prometheus`) and live page read each one as it comes.
Per-request latencies come from `RequestMetrics` (sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from minivllm.kv_cache_manager import KVCacheManager, PrefixCacheStats
from minivllm.spec_decode import SpecDecodingStats

if TYPE_CHECKING:
    from minivllm.scheduler_interface import SchedulerInterface
    from minivllm.scheduler_output import SchedulerOutput


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
