"""`LLMEngine`: wires the input processor, the scheduler, the executor and the output
processor (vLLM's ``LLMEngine`` + ``EngineCore``, in one object).

One `step()` = schedule, execute the model once on the flattened batch, advance the KV
bookkeeping, append the sampled tokens, retire finished requests, report progress.
Requests can be added or aborted between any two steps; that is all "continuous
batching" needs from the outside.

Each feature plugs in beside this loop, at one seam (docs/architecture.md): a scheduling
policy is a `Scheduler` subclass (`EngineConfig.scheduler_cls`); ``n > 1`` and beam search
are request groups on the output side (request_groups.py); overlap (async scheduling, on
by default on a CUDA device only) is the executor's Future, and a step function chosen once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future

from minivllm.config import EngineConfig
from minivllm.executor import Executor, make_executor
from minivllm.input_processor import InputProcessor, Prompt
from minivllm.kv_cache_manager import KVCacheManager
from minivllm.model_info import ModelInfo
from minivllm.models.model_files import resolve_model_path
from minivllm.output_processor import OutputProcessor
from minivllm.outputs import CompletionOutput, ModelRunnerOutput, RequestOutput
from minivllm.request_groups import RequestGroupSet
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.scheduler_interface import SchedulerInterface
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence
from minivllm.stats import EngineStats, StepStats, TokenCounts
from minivllm.utils import resolve_obj_by_qualname

__all__ = ["LLMEngine", "Prompt"]

logger = logging.getLogger("minivllm.engine")


class LLMEngine:
    """The engine loop, driven one `step()` at a time (vLLM's offline `LLMEngine`).

    ``executor`` defaults to the real model: in this process, or split across
    ``tensor_parallel_size`` worker processes; tests pass a fake one and the simulator a
    cost model. ``model_info`` (shape, tokenizer, EOS ids) defaults to what the model's
    files say; a fake executor comes with its own. ``clock`` is where every timestamp
    comes from. `close()` stops the executor's workers (garbage collection and
    interpreter exit do too)."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        clock=time.perf_counter,
        model_info: ModelInfo | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        # Input and output processing read the model's files themselves (no weights), so
        # the executor, maybe in other processes, only executes.
        self.model_info = model_info or ModelInfo.load(resolve_model_path(config.model))
        self.model_config = self.model_info.model_config
        tokenizer = self.model_info.tokenizer
        if executor is None:
            executor = make_executor(config, self.model_info.eos_token_ids)
        self.executor = ex = executor
        self.num_kv_blocks, self.max_model_len = ex.num_kv_blocks, ex.max_model_len
        self.kv_cache_manager = KVCacheManager(
            ex.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            config.share_forked_blocks,
        )  # fmt: skip
        scheduler_cls: type[SchedulerInterface] = resolve_obj_by_qualname(config.scheduler_cls)
        self.scheduler = scheduler_cls.from_config(
            config, self.kv_cache_manager, self.max_model_len, clock
        )
        self.input_processor = InputProcessor(
            tokenizer, self.model_config.vocab_size, ex.max_model_len,
            ex.num_kv_blocks, config.block_size, ex.device, config.seed,
        )  # fmt: skip
        self.output_processor = OutputProcessor(
            tokenizer, self.model_info.eos_token_ids, ex.max_model_len
        )
        self.request_groups = RequestGroupSet(self)  # n > 1, beam search (request_groups.py)
        self.engine_stats = EngineStats(self.scheduler, self.kv_cache_manager, clock)
        self.last_step: SchedulerOutput | None = None  # for walkthroughs
        # The step function, chosen once (vLLM's ``EngineCore.step_fn``); with async
        # scheduling, the step running behind, with the time its `step` call began.
        self.step_fn = self._step_async if config.use_async_scheduling else self._step_sync
        self.in_flight: tuple[SchedulerOutput, Future, float] | None = None
        if config.async_scheduling is None:  # the default: say what was chosen, and why
            reason = config.async_scheduling_off
            logger.info("async scheduling %s", f"off: {reason}" if reason else "on")

    def get_tokenizer(self):
        return self.model_info.tokenizer

    def close(self) -> None:
        self.executor.shutdown()  # its step thread and worker processes, if any

    # --- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError here; nothing is queued then.
        ``params.n > 1``: ``n`` child requests, gathered back (parallel_sampling.py)."""
        request_id = str(request_id)
        self.check_new_request_id(request_id)
        arrival_time = self.clock() if arrival_time is None else arrival_time
        if isinstance(params, SamplingParams) and params.n > 1:
            groups = self.request_groups["parallel_sampling"]
            return groups.add_request(request_id, prompt, params, arrival_time)
        self.add_sequence(self.input_processor.process(request_id, prompt, params, arrival_time))

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a processed request (a request group queues its members here)."""
        self.output_processor.add_request(seq)
        self.scheduler.add_request(seq)

    def check_new_request_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests or request_id in self.request_groups:
            raise ValueError(f"request id {request_id!r} is already in flight")

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: BeamSearchParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a beam-search request (beam_search.py); `step` reports it once, finished,
        its best beams first. Bad input raises ValueError here; nothing is queued then."""
        groups = self.request_groups["beam_search"]
        groups.add_request(str(request_id), prompt, params, arrival_time)

    def abort_request(self, request_id: str | Iterable[str]) -> bool | list[bool]:
        """Stop requests in any state and free their blocks at once.

        One id (anything `add_request` took: it goes through ``str`` the same way) or an
        iterable of ids. Returns True per request that was in flight, False for an unknown
        or finished id (a no-op, as in vLLM)."""
        if not isinstance(request_id, str) and isinstance(request_id, Iterable):
            return [self.abort_request(r) for r in request_id]
        request_id = str(request_id)
        aborted = self.request_groups.abort(request_id)  # a group's id: all its members
        if aborted is not None:
            return aborted
        if request_id not in self.scheduler.requests:
            return False
        self.scheduler.finish_requests(request_id, FinishReason.ABORT)
        self.output_processor.abort_request(request_id)
        return True

    # --- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and report every request that made progress (async
        scheduling: the batch before it, async_scheduler.py). While a request group needs a
        step's output to schedule the next (beam search), steps do not overlap."""
        if self.request_groups.in_lockstep:
            return self._finish_in_flight() if self.in_flight else self._step_sync()
        return self.step_fn()

    def _step_sync(self) -> list[RequestOutput]:
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_step, self.engine_stats.last = scheduler_output, None
        if scheduler_output.is_empty:
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        return self._process_output(scheduler_output, runner_output, start)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule step N+1 while step N runs, launch it behind N in the executor, then
        process N's output while N+1 runs."""
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_step, self.engine_stats.last = scheduler_output, None
        previous, self.in_flight = self.in_flight, None
        if not scheduler_output.is_empty:
            future = self.executor.execute_model(scheduler_output, non_block=True)
            self.in_flight = (scheduler_output, future, start)
        if previous is None:
            return []
        previous_output, future, previous_start = previous
        return self._process_output(previous_output, future.result(), previous_start)

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the step running behind and report it; nothing is scheduled."""
        (scheduler_output, future, start), self.in_flight = self.in_flight, None
        return self._process_output(scheduler_output, future.result(), start)

    def _process_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, start: float
    ) -> list[RequestOutput]:
        """Advance the bookkeeping past a step that ran, append its tokens, retire the
        requests that stopped, and report every request that made progress."""
        now = self.clock()
        self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, counts = [], TokenCounts()
        failed: dict[str, RequestOutput] = {}  # by the id its caller waits on
        for seq in scheduler_output.scheduled_seqs:
            if seq.is_finished:  # async: stopped or aborted after this step was scheduled
                continue
            try:
                if self.request_groups.consume(seq, runner_output, counts):  # a beam's group
                    continue
                stop = self.output_processor.process(seq, runner_output, now, counts)
                if stop is not None:
                    self.scheduler.finish_requests(seq.request_id, stop.reason, stop.stop_reason)
                output = self.output_processor.make_output(seq)
            except Exception as e:  # this request (its group) fails alone; the step goes on
                owner = self.request_groups.owner(seq.request_id)
                failed.setdefault(owner, self.failed_output(owner, seq, e))
                self.output_processor.abort_request(seq.request_id)
                continue
            if output is not None:
                outputs.append(output)
        if failed:
            owner = self.request_groups.owner
            outputs = [o for o in outputs if owner(o.request_id) not in failed]
            self.abort_request(list(failed))  # frees their blocks; groups go as groups
        outputs = self.request_groups.after_step(outputs, now)  # forks, drops, gathering
        outputs += failed.values()
        self.engine_stats.step_done(scheduler_output, start, counts)
        return outputs

    def failed_output(
        self, request_id: str, seq: Sequence | None, error: Exception
    ) -> RequestOutput:
        """The last output of a request that failed inside a step: finished, with
        finish_reason "error" and what went wrong (logged with its traceback here)."""
        logger.error("request %s failed in a step; it alone is aborted", request_id,
                     exc_info=error)  # fmt: skip
        return RequestOutput(
            request_id=request_id,
            prompt=seq.prompt if seq is not None else None,
            prompt_token_ids=seq.prompt_token_ids if seq is not None else [],
            outputs=[CompletionOutput(0, "", [], finish_reason=FinishReason.ERROR.value)],
            finished=True,
            metrics=seq.metrics if seq is not None else None,
            error=f"{type(error).__name__}: {error}",
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and the hit-rate counters (like vLLM's), e.g. between
        benchmark runs. Returns False, doing nothing, while requests are in flight."""
        return self.kv_cache_manager.reset_prefix_cache()

    # --- statistics (stats.py) -----------------------------------------------------------

    @property
    def last_stats(self) -> StepStats | None:  # the last step's snapshot, if it ran
        return self.engine_stats.last

    def record_steps(self) -> None:
        """Keep every step's `StepStats` from now on, until `take_step_stats`."""
        self.engine_stats.record_steps()

    def take_step_stats(self) -> list[StepStats]:
        """The steps' snapshots since `record_steps`, oldest first; recording stops."""
        return self.engine_stats.take_step_stats()

    def make_stats(self) -> StepStats:
        """The engine's queues, KV pool and counters now (vLLM's ``make_stats``)."""
        return self.engine_stats.make_stats()

    def stats(self) -> dict:
        """`make_stats` as a dict, with the config, e.g. for a progress display."""
        return self.engine_stats.as_dict(self.config)

    @property
    def spec_decoding_stats(self):  # vLLM's ``SpecDecodingStats``; None when it is off
        return self.engine_stats.spec_decoding
