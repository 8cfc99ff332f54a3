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

Other policies are subclasses: `AsyncScheduler` (async_scheduler.py) and
`SpecDecodeScheduler` (spec_decode/scheduler.py), which spends the leftover budget on
draft tokens (`_schedule_leftover`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus


class Scheduler:
    """``num_computed_tokens`` advances in `update_from_output`, after the step ran: until
    then the scheduled tokens' keys and values are not in the cache. (vLLM advances it
    when scheduling, so that it can schedule the next step while this one runs: that is
    `AsyncScheduler`, async_scheduler.py.)"""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock=time.perf_counter,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first, so running[-1] is the newest
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_waiting_preempted = 0  # of ``waiting``, those preempted (at its front)

    @classmethod
    def from_config(cls, config, kv_cache_manager, max_model_len, clock) -> Scheduler:
        """The engine's way in: every policy builds itself from the settings."""
        del max_model_len  # only drafts need it (spec_decode/scheduler.py)
        return cls(kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, clock)

    def add_request(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        budget = self._schedule_waiting(out, budget)
        if out.is_empty and self.waiting and self.running:
            budget = self._unblock_idle_beams(out, budget)
        self._schedule_leftover(out, budget)
        if not out.is_empty:  # an empty step does not run: its copies wait for the next
            out.blocks_to_copy = self.kv_cache_manager.take_blocks_to_copy()  # copy-on-write
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences, oldest first. Each needs blocks for its new tokens; if the
        pool is empty, evict the newest running sequence until this one fits."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' rows (beam_search.py)
                i += 1
                continue
            while not self.kv_cache_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_to_step(out, seq, num_new)
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Waiting sequences, first come first served. None are admitted in a step that
        preempted: the pool is full, so the admitted one would be evicted next."""
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
            if seq.status is SequenceStatus.WAITING:  # first admission, not a readmission
                seq.num_cached_tokens = num_cached
                seq.metrics.first_scheduled_time = self.clock()
            else:
                self.num_waiting_preempted -= 1
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            self._add_to_step(out, seq, num_new)
            budget -= num_new
        return budget

    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        """Schedule ``num_new`` tokens of ``seq``, and register the blocks they will fill
        now (prefix caching): a request admitted later in this step can share them, as every
        layer writes the step's keys and values before attention reads any."""
        out.add(seq, num_new)
        self.kv_cache_manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)

    def _schedule_leftover(self, out: SchedulerOutput, budget: int) -> None:
        """What a policy does with the budget left once every real token is placed:
        nothing here (draft tokens: spec_decode/scheduler.py)."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """After the model ran: the scheduled tokens' keys and values are in the cache.
        Nothing is registered for prefix caching: every token the step computed was known
        when it was scheduled, and `_add_to_step` registered its blocks."""
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        for seq in scheduler_output.scheduled_seqs:
            seq.num_computed_tokens += num_scheduled_tokens[seq.request_id]

    def fork_request(self, parent: Sequence, child: Sequence) -> None:
        """Beam search: ``child`` continues ``parent``'s computed tokens. It shares the
        parent's blocks (kv_cache_manager.py's `fork`) and runs at once; if the parent
        holds none (preempted), the batch is full, or the pool cannot give the copies of a
        fork without sharing, it waits to be computed like a new request instead."""
        self.requests[child.request_id] = child
        if (
            parent.status is SequenceStatus.RUNNING
            and len(self.running) < self.max_num_seqs
            and self.kv_cache_manager.fork(parent, child)
        ):
            child.status = SequenceStatus.RUNNING
            child.metrics.first_scheduled_time = self.clock()
            self.running.append(child)
        else:
            self.waiting.append(child)

    def _unblock_idle_beams(self, out: SchedulerOutput, budget: int) -> int:
        """Beam search's one deadlock: every running sequence is a beam waiting, idle, for
        a sibling's row, while that sibling waits for room in the pool or the batch.
        Preempt idle beams, newest first, until the head of the queue is admitted. They go
        to the back of the queue, not the front: their rows are kept, so recomputing them
        is no progress, and at the front they would take the room straight back."""
        # Admission follows even if this step preempted already: nobody left running needs
        # the room, so `_schedule_waiting`'s rule against it does not apply.
        preempted, out.preempted = out.preempted, []
        victims = []
        while out.is_empty and self.running:
            victim = self.running.pop()
            self._preempt(victim)
            self.waiting.popleft()  # held out of the queue until the head is admitted
            victims.append(victim)
            budget = self._schedule_waiting(out, budget)
        self.waiting.extend(reversed(victims))  # oldest first
        out.preempted = preempted + victims
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.num_waiting_preempted += 1
        self.waiting.appendleft(seq)

    def finish_requests(
        self, request_ids: str | Iterable[str], reason: FinishReason, stop_reason=None
    ) -> None:
        """Take each request out of its queue, give its blocks back, mark it finished."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = self.clock()
        for request_id in request_ids:
            seq = self.requests.pop(request_id)
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
                if seq.status is SequenceStatus.PREEMPTED:
                    self.num_waiting_preempted -= 1
            self.kv_cache_manager.free(seq)
            seq.finish(reason, now, stop_reason)
