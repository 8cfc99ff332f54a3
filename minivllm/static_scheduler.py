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

Padding rows really run through the model and attention (chunks of `PAD_TOKEN_ID` that
advance no request); they are not a sleep. Prompts are padded on the right: the padding's
keys/values land in the request's own region at positions it has not reached yet and are
overwritten before any real token can attend to them, so no attention mask is needed. (A
left-padded server also attends over the padding keys; this version is, if anything,
slightly cheaper than the real thing.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus


class StaticBatchScheduler:
    """Same interface as `Scheduler` (`SchedulerInterface`). ``running`` is the current
    batch, finished members included: their slots stay occupied (and padded) until the
    whole batch ends."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_model_len: int,
        clock=time.perf_counter,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.blocks_per_request = kv_cache_manager.num_blocks_needed(max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # unfinished ones
        self.num_decode_steps = 0  # lockstep decode steps since the batch's prefill
        self.num_batches = 0
        self.num_preemptions = 0  # every request has its full region: never preempts
        self.num_waiting_preempted = 0

    @classmethod
    def from_config(cls, config, kv_cache_manager, max_model_len, clock) -> StaticBatchScheduler:
        return cls(kv_cache_manager, config.max_num_seqs, max_model_len, clock)

    def add_request(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

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
            seq.metrics.first_scheduled_time = self.clock()
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
                out.add_padding(seq, seq.num_tokens, padded_len - seq.num_tokens)
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
            out.add_padding(seq, position, 1)
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """After the model ran: the scheduled tokens' keys and values are in the cache."""
        for seq in scheduler_output.scheduled_seqs:
            seq.num_computed_tokens += scheduler_output.num_scheduled_tokens[seq.request_id]

    def finish_requests(
        self, request_ids: str | Iterable[str], reason: FinishReason, stop_reason=None
    ) -> None:
        """Mark requests finished. Their slots and regions stay with the batch; when the
        last member finishes, the batch ends and every region goes back to the pool."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = self.clock()
        for request_id in request_ids:
            seq = self.requests.pop(request_id)
            if seq.status is not SequenceStatus.RUNNING:  # aborted before its batch started
                self.waiting.remove(seq)
            seq.finish(reason, now, stop_reason)
        if self.running and all(member.is_finished for member in self.running):
            self._end_batch()

    def _end_batch(self) -> None:
        for seq in self.running:
            self.kv_cache_manager.free(seq)
        self.running = []
