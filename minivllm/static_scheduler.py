"""Static (request-level) batching: how servers batched before continuous batching.

Kept beside the continuous `Scheduler` so the difference can be measured on the same
model code, batch-size cap and attention backend (``scheduling_policy="static"``):

- A batch of up to ``max_num_seqs`` waiting requests is formed only when the previous
  batch has completely finished; nobody joins a running batch.
- Each member reserves a whole ``max_model_len`` region of the KV cache up front, as a
  server without paging must (it cannot know how long the answer will be). The batch is
  also capped by how many such regions fit in the pool.
- The first step prefills every prompt *padded to the batch's longest prompt*; then the
  batch decodes in lockstep until its longest request ends. A member that finished early
  keeps its slot and keeps burning one padding row per step.

Padding rows really run through the model and attention (`PaddingRows`); they are not a
sleep. Prompts are padded on the right: the padding's keys/values land in the request's
own region at positions it has not reached yet and are overwritten before any real token
can attend to them, so no attention mask is needed. (A left-padded server also attends
over the padding keys; this version is, if anything, slightly cheaper than the real thing.)
"""

from __future__ import annotations

from collections import deque

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.scheduler import PaddingRows, SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus


class StaticBatchScheduler:
    """Same interface as `Scheduler`: `add`, `schedule`, `update_computed`, `finish`,
    `has_unfinished`. ``running`` is the current batch, finished members included: their
    slots stay occupied (and padded) until the whole batch ends."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.blocks_per_request = kv_cache_manager.num_blocks_needed(max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_decode_steps = 0  # lockstep decode steps since the batch's prefill
        self.num_batches = 0
        self.num_preemptions = 0  # every request has its full region: never preempts

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not seq.is_finished for seq in self.running)

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            return self._start_batch()
        return self._decode_batch()

    def _start_batch(self) -> SchedulerOutput:
        """Admit up to ``max_num_seqs`` requests that each get a full region, and prefill
        them all in one step, every prompt padded to the longest."""
        while (
            self.waiting
            and len(self.running) < self.max_num_seqs
            and self.kv_cache_manager.num_free_blocks >= self.blocks_per_request
        ):
            seq = self.waiting.popleft()
            # Reserve the region: blocks for max_model_len tokens, used or not.
            reserved = self.kv_cache_manager.allocate_slots(seq, self.max_model_len)
            assert reserved, "checked above: a whole region is free"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        out = SchedulerOutput()
        if not self.running:
            return out
        self.num_batches += 1
        self.num_decode_steps = 0
        padded_len = max(seq.num_tokens for seq in self.running)
        for seq in self.running:
            out.add(seq, seq.num_tokens)
            if seq.num_tokens < padded_len:
                padding = padded_len - seq.num_tokens
                out.padding.append(PaddingRows(seq, seq.num_tokens, padding))
        return out

    def _decode_batch(self) -> SchedulerOutput:
        """One lockstep decode: a real token for each unfinished member, a padding row
        for each finished one."""
        self.num_decode_steps += 1
        out = SchedulerOutput()
        for seq in self.running:
            if not seq.is_finished:
                out.add(seq, seq.num_uncomputed_tokens)  # always 1 in lockstep
                continue
            # Where this slot would be had it kept generating; it stays inside its region.
            position = seq.num_prompt_tokens + self.num_decode_steps - 1
            position = min(position, self.max_model_len - 1)
            out.padding.append(PaddingRows(seq, position, 1))
        return out

    def update_computed(self, scheduled: SchedulerOutput) -> None:
        """After the model ran: the scheduled tokens' keys and values are in the cache."""
        for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens):
            seq.num_computed_tokens += num_new

    def finish(self, seq: Sequence, reason: FinishReason, now: float, stop_reason=None) -> None:
        """Mark ``seq`` finished. Its slot and region stay with the batch; when the last
        member finishes, the batch ends and every region goes back to the pool."""
        if seq in self.waiting:  # aborted before its batch started
            self.waiting.remove(seq)
        seq.finish(reason, now, stop_reason)
        if all(member.is_finished for member in self.running):
            self._end_batch()

    def _end_batch(self) -> None:
        for seq in self.running:
            self.kv_cache_manager.free(seq)
        self.running = []
