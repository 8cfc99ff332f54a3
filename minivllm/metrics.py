"""Per-step statistics (vLLM's ``IterationStats``), recorded by `LLMEngine.step` when
``engine.step_log`` is a list: how many prefill, decode and padding token rows ran, queue
lengths, KV blocks in use. Per-request latencies come from `RequestMetrics` (sequence.py);
benchmark summaries over a whole run live in `minivllm.bench.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile

from minivllm.sequence import SequenceStatus


@dataclass
class StepStats:
    """One engine step; counts of sequences and blocks are taken after the step."""

    start_time: float
    end_time: float
    num_prefill_tokens: int
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

    @classmethod
    def capture(cls, engine, scheduled, start_time: float, end_time: float) -> StepStats:
        """Read one finished step off the engine (`LLMEngine`) and its `SchedulerOutput`.
        Rows that advanced no request are static batching's padding."""
        scheduler, kv = engine.scheduler, engine.kv_cache_manager
        # Preempted sequences go back to the *front* of the waiting queue, so counting
        # them stops at the first new one: O(preempted), not O(waiting) per step (with
        # 100,000 requests queued offline, a full scan every step was quadratic).
        num_preempted = sum(
            1 for _ in takewhile(lambda s: s.status is SequenceStatus.PREEMPTED, scheduler.waiting)
        )
        return cls(
            start_time=start_time,
            end_time=end_time,
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_padding_tokens=scheduled.num_wasted_tokens,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) - num_preempted,
            num_preempted=num_preempted,
            num_kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            num_kv_tokens_stored=sum(s.num_computed_tokens for s in scheduler.running),
            prefill_ids=scheduled.prefill_ids,
            decode_ids=scheduled.decode_ids,
            padding_ids=scheduled.wasted_ids,
            preempted_ids=[s.request_id for s in scheduled.preempted],
        )

    @property
    def num_computed_slots(self) -> int:
        """Token rows the model ran on this step, padding included."""
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_padding_tokens
