"""The scheduler for async scheduling (vLLM's ``AsyncScheduler``): step N+1 is scheduled
while step N runs, before step N's sampled tokens are known.

So the bookkeeping runs one step ahead. ``num_computed_tokens`` advances when a chunk is
*scheduled*, not after it ran, and a chunk that samples leaves its request one
*placeholder*: a token that exists but has no id yet (``num_output_placeholders``). The
next step can then schedule that request's decode at once; its input token is the
placeholder, which the model runner replaces, in its own copy of the chunk, with its own
last sample before the step runs. `update_from_output` only retires the placeholder: the
output processor appends the real token as usual. A request that stops on step N's token
has been scheduled in step N+1 already; the engine throws that step's token away (vLLM
does the same).

It is on by default where it overlaps real work, on a CUDA device, and off on a CPU:
`EngineConfig.use_async_scheduling` decides, and `async_scheduling_unsupported` says where
it cannot run (the static policy, speculative decoding, tensor parallelism, the
numba-cuda backend). The step runs behind on the executor's step thread
(``execute_model(..., non_block=True)``, executor.py). What it hides of the engine's CPU
time per step is measured in docs/tutorial/what-a-gpu-would-do.md, "The engine's own time
per step".
"""

from __future__ import annotations

from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler import Scheduler
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import Sequence


class AsyncScheduler(Scheduler):
    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        super()._add_to_step(out, seq, num_new)  # caches only blocks of known tokens
        seq.num_computed_tokens += num_new  # its keys and values will be in the cache
        if out.chunk_of[seq.request_id].sample:
            seq.num_output_placeholders += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        """Step N's tokens are known: its placeholders are retired (the output processor
        appends the tokens next). ``num_computed_tokens`` moved when the step was scheduled.

        Nothing is registered for prefix caching here (nor by the synchronous scheduler
        after a step without drafts). A block can be shared once all its tokens are
        scheduled and known. Scheduling registers every such block (`_add_to_step`); one
        whose last token was a placeholder then becomes registrable when the output
        processor appends that token, and the request's next schedule registers it. That
        comes before anyone can look it up: running requests are scheduled before waiting
        ones are admitted, and every running request is scheduled in every step (each was
        given a token of the step before and needs one now, but the newest, which may still
        be mid-prompt, so the budget covers them all; a beam left out of a step waits for
        its siblings and has no new token either). So the same blocks are registered as
        without async scheduling whenever a request is admitted, preempted or finishes,
        and no request costs a call into the KV-cache manager here."""
        chunk_of = scheduler_output.chunk_of
        for seq in scheduler_output.scheduled_seqs:
            if chunk_of[seq.request_id].sample:
                seq.num_output_placeholders -= 1
