"""`LLMEngine`: wires the input processor, the scheduler, the executor and the output
processor (vLLM's ``LLMEngine`` + ``EngineCore``, in one object).

One `step()` = schedule, execute the model once on the flattened batch, advance the KV
bookkeeping, append the sampled tokens, retire finished requests, report progress.
Requests can be added or aborted between any two steps; that is all "continuous
batching" needs from the outside.

Each feature plugs in beside this loop, at one seam (docs/architecture.md): a scheduling
policy is a `Scheduler` subclass (`EngineConfig.scheduler_cls`); ``n > 1`` and beam search
are request groups on the output side (request_groups.py); overlap (async scheduling, on
by default on a CUDA device only) is the executor's Future, and a step function chosen once;
structured outputs are a manager beside the scheduler (structured_output/), called at five
fixed places.
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
from minivllm.output_processor import OutputProcessor, StopDecision
from minivllm.outputs import ModelRunnerOutput, RequestOutput
from minivllm.request_groups import RequestGroupSet
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.scheduler_interface import SchedulerInterface
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence
from minivllm.stats import EngineStats, StepStats, TokenCounts
from minivllm.structured_output import StructuredOutputManager
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
        # Requests waiting for their grammar, and the admitted ones' matchers (empty unless
        # a request asked for structured outputs).
        self.structured_output = StructuredOutputManager(tokenizer, self.model_config.vocab_size)
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
        self.structured_output.shutdown()
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
        self.structured_output.check(params, self.config.scheduling_policy)
        if isinstance(params, SamplingParams) and params.n > 1:
            groups = self.request_groups["parallel_sampling"]
            return groups.add_request(request_id, prompt, params, arrival_time)
        self.add_sequence(self.input_processor.process(request_id, prompt, params, arrival_time))

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a processed request (a request group queues its members here). One with
        structured outputs reaches the scheduler once its grammar is compiled."""
        self.output_processor.add_request(seq)
        if not self.structured_output.hold(seq):  # held until its grammar is compiled
            self.scheduler.add_request(seq)

    def check_new_request_id(self, request_id: str) -> None:
        in_flight = (self.scheduler.requests, self.request_groups, self.structured_output.waiting)
        if any(request_id in ids for ids in in_flight):
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
        if self.structured_output.abort(request_id, self.clock()):  # waited for its grammar
            self.output_processor.abort_request(request_id)
            return True
        if request_id not in self.scheduler.requests:
            return False
        self.scheduler.finish_requests(request_id, FinishReason.ABORT)
        self.output_processor.abort_request(request_id)
        return True

    # --- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.structured_output.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self.structured_output.waiting)

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and report every request that made progress (async
        scheduling: the batch before it, async_scheduler.py). While a request group needs a
        step's output to schedule the next (beam search, structured outputs' masks), steps
        do not overlap. A request whose grammar failed to compile fails alone."""
        structured = self.structured_output
        if structured.waiting and (failed := structured.admit_ready(self.scheduler)):
            return self._fail_requests(failed)
        if self.step_fn == self._step_async and (
            self.request_groups.in_lockstep or structured.pauses_overlap()
        ):
            return self._finish_in_flight() if self.in_flight else self._step_sync()
        return self.step_fn()

    def _step_sync(self) -> list[RequestOutput]:
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_step, self.engine_stats.last = scheduler_output, None
        if scheduler_output.is_empty:
            return []
        scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(scheduler_output)
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
        failures: list[tuple[Sequence, Exception]] = []
        structured = self.structured_output
        for seq in scheduler_output.scheduled_seqs:
            if seq.is_finished:  # async: stopped or aborted after this step was scheduled
                continue
            try:
                if self.request_groups.consume(seq, runner_output, counts):  # a beam's group
                    continue
                stop = self.output_processor.process(seq, runner_output, now, counts)
                if structured.requests and structured.advance(seq, stopped=stop is not None):
                    stop = stop or StopDecision(FinishReason.STOP)  # its grammar is complete
                if stop is not None:
                    self.scheduler.finish_requests(seq.request_id, stop.reason, stop.stop_reason)
                output = self.output_processor.make_output(seq)
            except Exception as e:  # this request (its group) fails alone; the step goes on
                failures.append((seq, e))
                continue
            if output is not None:
                outputs.append(output)
        failed = self._fail_requests(failures) if failures else []
        if failed:  # a failed group's members that did report are not reported
            gone = {output.request_id for output in failed}
            outputs = [o for o in outputs if self.request_groups.owner(o.request_id) not in gone]
        outputs = self.request_groups.after_step(outputs, now) + failed  # forks, drops, gathering
        self.engine_stats.step_done(scheduler_output, start, counts)
        return outputs

    def _fail_requests(self, failures: list[tuple[Sequence, Exception]]) -> list[RequestOutput]:
        """Requests that failed (in a step, or their grammar's compile) end alone, with
        finish_reason "error": one output per id a caller waits on; a group goes whole."""
        failed: dict[str, RequestOutput] = {}
        for seq, error in failures:
            owner = self.request_groups.owner(seq.request_id)
            failed.setdefault(owner, self.fail_request(owner, seq, error))
            self.output_processor.abort_request(seq.request_id)
        self.abort_request(list(failed))  # frees their blocks
        return list(failed.values())

    def fail_request(self, request_id: str, seq: Sequence | None, error: Exception):
        """Log a failed request with its traceback; its last output, finish_reason "error"."""
        logger.error("request %s failed in a step; it alone is aborted", request_id,
                     exc_info=error)  # fmt: skip
        return self.output_processor.failed_output(request_id, seq, error)

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
