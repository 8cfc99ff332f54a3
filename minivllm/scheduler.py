"""The continuous-batching scheduler (vLLM v1 style): no prefill or decode phases.

Every sequence has ``num_computed_tokens`` catching up with its known tokens. Each step
fills one token budget: running sequences first (a decode needs one token, an unfinished
prefill its next chunk), then waiting sequences in arrival order, their prompts *chunked*
to whatever budget is left. So prefill chunks and decodes share a step, and a long prompt
never stalls the decodes of everyone else. With prefix caching, a waiting sequence first
shares the cached blocks of its prompt's prefix and starts computing after them.

When the KV pool runs dry, the newest running sequence is *preempted by recompute*: its
blocks go back to the pool and it returns to the front of the waiting queue, to be
recomputed (prompt and output so far) when there is room again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class PaddingRows:
    """Token rows computed only to be thrown away: static batching's waste.

    ``num_tokens`` rows at positions ``start_position, start_position + 1, ...`` go through
    the model and attention like a chunk of ``seq``, in ``seq``'s KV region, but nothing is
    sampled from them. Only `StaticBatchScheduler` makes them: ``seq`` is the batch member
    whose slot they fill (a prompt shorter than the longest, or a request already done)."""

    seq: Sequence
    start_position: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``seqs[i]``, starting at
    its ``num_computed_tokens``, then the ``padding`` rows (static batching only)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Whether each chunk catches up on known tokens (prefill) or computes the one token
    # just sampled (decode); fixed when scheduled, as the sequence moves on after the step.
    is_prefill: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    padding: list[PaddingRows] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.is_prefill.append(seq.is_prefill)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for n, prefill in zip(self.num_new_tokens, self.is_prefill) if not prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_num_tokens - self.num_decode_tokens

    @property
    def num_padding_tokens(self) -> int:
        return sum(rows.num_tokens for rows in self.padding)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first, so running[-1] is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences, oldest first. Each needs blocks for its new tokens; if the
        #    pool is empty, evict the newest running sequence until this one fits.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.add(seq, num_new)
                budget -= num_new
                i += 1

        # 2. Waiting sequences, first come first served. None are admitted in a step that
        #    preempted: the pool is full, so the admitted one would be evicted next.
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            # A prefix-cache hit: these blocks are shared, not computed (a preempted
            # sequence may hit its own old blocks, output tokens included).
            cached_blocks = self.kv_cache_manager.get_computed_blocks(seq)
            num_cached = len(cached_blocks) * self.kv_cache_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv_cache_manager.allocate_slots(seq, num_new, cached_blocks):
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(seq)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            out.add(seq, num_new)
            budget -= num_new
        return out

    def update_computed(self, scheduled: SchedulerOutput) -> None:
        """After the model ran: the scheduled tokens' keys and values are in the cache, and
        the blocks they filled can be shared by later requests (prefix caching)."""
        for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.kv_cache_manager.cache_full_blocks(seq, num_new)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason, now: float, stop_reason=None) -> None:
        """Take ``seq`` out of its queue, give its blocks back and mark it finished."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.finish(reason, now, stop_reason)
