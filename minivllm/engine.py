"""`LLMEngine`: wires the input processor, the scheduler, the executor and the output
processor (vLLM's ``LLMEngine`` + ``EngineCore``, in one object).

One `step()` = schedule, execute the model once on the flattened batch, advance the KV
bookkeeping, append the sampled tokens, retire finished requests, report progress.
Requests can be added or aborted between any two steps; that is all "continuous
batching" needs from the outside. With async scheduling (on by default wherever it is
supported: `EngineConfig.use_async_scheduling`), a step's batch runs on a worker thread
while the next is scheduled, and `step()` reports the batch before it
(async_scheduler.py); ``async_scheduling=False`` makes every `step()` report itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

from minivllm.async_scheduler import AsyncScheduler
from minivllm.beam_search import (
    BeamSearchGroup,
    BeamSearchGroups,
    beam_request_id,
    beams_to_keep,
)
from minivllm.config import EngineConfig
from minivllm.executor import Executor, make_executor
from minivllm.input_processor import InputProcessor, Prompt
from minivllm.kv_cache_manager import KVCacheManager
from minivllm.model_info import ModelInfo
from minivllm.models.model_files import resolve_model_path
from minivllm.output_processor import OutputProcessor, StopDecision
from minivllm.outputs import ModelRunnerOutput, RequestOutput
from minivllm.parallel_sampling import ParentRequest, ParentRequests
from minivllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.scheduler_interface import SchedulerInterface
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason
from minivllm.spec_decode import NgramProposer, SpecDecodingStats
from minivllm.static_scheduler import StaticBatchScheduler
from minivllm.stats import StepStats
from minivllm.structured_output import StructuredOutputManager, validate_structured_outputs

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
        self.executor = executor
        ex = self.executor
        self.num_kv_blocks, self.max_model_len = ex.num_kv_blocks, ex.max_model_len
        self.kv_cache_manager = KVCacheManager(
            ex.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            config.share_forked_blocks,
        )  # fmt: skip
        self.scheduler = self._make_scheduler()
        self.input_processor = InputProcessor(
            tokenizer, self.model_config.vocab_size, ex.max_model_len,
            ex.num_kv_blocks, config.block_size, ex.device, config.seed,
        )  # fmt: skip
        self.output_processor = OutputProcessor(
            tokenizer, self.model_info.eos_token_ids, ex.max_model_len
        )
        self.parent_requests = ParentRequests()  # n > 1: one parent, n child requests
        self.beam_groups = BeamSearchGroups()  # beam search: one group, its live beams
        # Structured outputs: requests waiting for their grammar, and the matchers of the
        # admitted ones (structured_output/). Empty unless a request asked for one.
        self.structured_output = StructuredOutputManager(tokenizer, self.model_config.vocab_size)
        self.last_step: SchedulerOutput | None = None  # for walkthroughs
        self.last_stats: StepStats | None = None  # the last step's snapshot, if it ran
        self.step_log: list[StepStats] | None = None  # set to [] to record every step
        # Async scheduling: the step running on the worker thread while the next is
        # scheduled, with the time its `step` call began.
        self.step_worker = ThreadPoolExecutor(1) if config.use_async_scheduling else None
        if config.async_scheduling is None and not config.use_async_scheduling:
            logger.info("async scheduling off: %s", config.async_scheduling_unsupported)
        self.in_flight: tuple[SchedulerOutput, Future, float] | None = None

    @classmethod
    def from_engine_args(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def _make_scheduler(self) -> SchedulerInterface:
        c = self.config
        if c.scheduling_policy == "static":  # for comparison only: see static_scheduler.py
            return StaticBatchScheduler(
                self.kv_cache_manager, c.max_num_seqs, self.max_model_len, self.clock
            )
        proposer = None
        if c.speculative_config is not None:
            spec = c.speculative_config
            proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        scheduler_cls = AsyncScheduler if c.use_async_scheduling else Scheduler
        return scheduler_cls(
            self.kv_cache_manager, c.max_num_seqs, c.max_num_batched_tokens, self.clock,
            self.max_model_len, proposer,
        )  # fmt: skip

    def get_tokenizer(self):
        return self.model_info.tokenizer

    def close(self) -> None:
        """Stop the executor (its worker processes, if any); the engine is done then."""
        if self.step_worker is not None:
            self.step_worker.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()

    # --- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError here; nothing is queued then.

        ``params.n > 1`` fans out into ``n`` child requests (parallel_sampling.py) whose
        outputs `step` gathers back under ``request_id``."""
        request_id = str(request_id)
        self._check_new_request_id(request_id)
        arrival_time = self.clock() if arrival_time is None else arrival_time
        parent = None
        structured = isinstance(params, SamplingParams) and params.structured_outputs is not None
        if structured:
            self._check_structured_outputs(params)
        if isinstance(params, SamplingParams) and params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is more than max_num_seqs={self.config.max_num_seqs}: the n "
                "samples of a prompt are meant to run side by side, sharing its blocks"
            )
        if isinstance(params, SamplingParams) and params.n > 1:
            parent = ParentRequest(request_id, params)
            children = [(c, parent.child_params(i)) for i, c in enumerate(parent.child_ids)]
            if any(c in self.scheduler.requests for c in parent.child_ids):
                raise ValueError(f"a child id of request {request_id!r} is already in flight")
        else:
            children = [(request_id, params)]
        seqs = [self.input_processor.process(r, prompt, p, arrival_time) for r, p in children]
        if parent is not None:
            self.parent_requests.add(parent)
        for seq in seqs:
            seq.shares_prompt = parent is not None  # siblings share even without caching
            self.output_processor.add_request(seq)
            if structured:  # the scheduler gets it once its grammar is compiled
                self.structured_output.add_request(seq)
            else:
                self.scheduler.add_request(seq)

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """A constraint that cannot compile, or a setting it cannot work with, raises
        ValueError naming the field, before anything is queued."""
        if self.config.scheduling_policy != "continuous":
            raise ValueError("structured_outputs needs the continuous scheduling policy")
        if self.model_info.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer")
        validate_structured_outputs(params.structured_outputs)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler's waiting queue
        (vLLM's WAITING_FOR_FSM -> WAITING). One whose compile failed (validation passed,
        so only a resource limit can do that) finishes, aborted: its output is returned."""
        ready, failed = self.structured_output.take_ready()
        for seq in ready:
            self.scheduler.add_request(seq)
        outputs = []
        for seq, error in failed:
            logger.error("request %s: its grammar did not compile: %s", seq.request_id, error)
            seq.finish(FinishReason.ABORT, self.clock())
            output = self.output_processor.make_output(seq)
            self.output_processor.abort_request(seq.request_id)
            if output is not None:
                outputs.append(output)
        return self.parent_requests.gather(outputs)

    def _check_new_request_id(self, request_id: str) -> None:
        if (
            request_id in self.scheduler.requests
            or request_id in self.parent_requests
            or request_id in self.beam_groups
        ):
            raise ValueError(f"request id {request_id!r} is already in flight")

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: BeamSearchParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a beam-search request (beam_search.py). `step` reports it once, finished:
        its ``beam_width`` best beams as ``outputs``, best first. Bad input raises
        ValueError here; nothing is queued then."""
        request_id = str(request_id)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.config.scheduling_policy != "continuous":
            raise ValueError("beam search needs the continuous scheduling policy")
        if params.beam_width > self.config.max_num_seqs:
            raise ValueError(
                f"beam_width={params.beam_width} is more than "
                f"max_num_seqs={self.config.max_num_seqs}: the beams run side by side"
            )
        eos_token_ids = self.model_info.eos_token_ids
        if beams_to_keep(params.beam_width, len(eos_token_ids)) > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width={params.beam_width} asks each beam for "
                f"{beams_to_keep(params.beam_width, len(eos_token_ids))} logprobs with this "
                f"model's {len(eos_token_ids)} EOS ids, more than {MAX_LOGPROBS}"
            )
        self._check_new_request_id(request_id)
        first_id = beam_request_id(request_id, 0)
        if first_id in self.scheduler.requests:
            raise ValueError(f"a beam id of request {request_id!r} is already in flight")
        arrival_time = self.clock() if arrival_time is None else arrival_time
        sampling_params = BeamSearchGroup.sampling_params(params, len(eos_token_ids))
        seq = self.input_processor.process(first_id, prompt, sampling_params, arrival_time)
        # Beams share blocks through forks; a preempted one finds its shared full blocks
        # again by their hashes (unless sharing is off: then nothing is shared).
        seq.shares_prompt = self.config.share_forked_blocks
        max_tokens = min(params.max_tokens, max(1, self.max_model_len - seq.num_prompt_tokens))
        group = BeamSearchGroup(request_id, params, seq, eos_token_ids, max_tokens)
        self.beam_groups.add(group)
        self.scheduler.add_request(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> bool | list[bool]:
        """Stop requests in any state and free their blocks at once.

        One id (anything `add_request` took: it goes through ``str`` the same way) or an
        iterable of ids. Returns True per request that was in flight, False for an unknown
        or finished id (a no-op, as in vLLM)."""
        if not isinstance(request_id, str) and isinstance(request_id, Iterable):
            return [self.abort_request(r) for r in request_id]
        request_id = str(request_id)
        parent = self.parent_requests.pop(request_id)
        if parent is not None:  # every child still in flight
            return any([self.abort_request(c) for c in parent.child_ids])
        group = self.beam_groups.pop(request_id)
        if group is not None:  # every live beam
            self.scheduler.finish_requests(group.beam_ids, FinishReason.ABORT)
            return True
        if request_id in self.beam_groups.group_of:  # one beam is not a request of its own
            return False
        if request_id in self.structured_output.waiting:  # never reached the scheduler
            seq, _ = self.structured_output.waiting[request_id]
            self.structured_output.remove(request_id)
            seq.finish(FinishReason.ABORT, self.clock())
            self.output_processor.abort_request(request_id)
            return True
        self.structured_output.remove(request_id)
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
        """Schedule one batch, run it, and report every request that made progress.

        With async scheduling, the batch runs on a worker thread and the step reports the
        batch before it, which ran while this one was scheduled (async_scheduler.py).
        While a beam search is in flight, steps do not overlap: its beams are chosen from a
        step's logprobs, so the next step cannot be scheduled before they are known. The
        step in flight is finished first; then each step runs and reports itself (the
        async scheduler's one-step-ahead bookkeeping is settled by then). The same holds
        while a request with structured outputs is in flight: its next mask depends on
        the token the step before samples."""
        structured = self.structured_output
        if structured.waiting and (failed := self._admit_compiled()):
            return failed
        if self.step_worker is not None and not self.beam_groups.groups:
            if not structured.requests:
                return self._step_async()
            if not self._logged_structured_sync:
                logger.info(
                    "async scheduling paused while structured-output requests are in flight: "
                    "each one's next mask depends on the token the step before samples"
                )
                self._logged_structured_sync = True
        if self.in_flight is not None:
            return self._finish_in_flight()
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_step, self.last_stats = scheduler_output, None
        if scheduler_output.is_empty:
            if structured.waiting and not self.scheduler.has_unfinished_requests():
                structured.wait_for_compile(timeout=0.05)  # nothing else to do meanwhile
            return []
        if structured.requests:
            scheduler_output.grammar_bitmask = structured.grammar_bitmask(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        return self._process_output(scheduler_output, runner_output, start)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule step N+1 while step N runs, launch it behind N on the worker thread,
        then process N's output while N+1 runs."""
        start = self.clock()
        scheduler_output = self.scheduler.schedule()
        self.last_step, self.last_stats = scheduler_output, None
        previous, self.in_flight = self.in_flight, None
        if not scheduler_output.is_empty:
            future = self.step_worker.submit(self.executor.execute_model, scheduler_output)
            self.in_flight = (scheduler_output, future, start)
        if previous is None:
            return []
        previous_output, future, previous_start = previous
        return self._process_output(previous_output, future.result(), previous_start)

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the step on the worker thread and report it; nothing is scheduled."""
        (scheduler_output, future, start), self.in_flight = self.in_flight, None
        return self._process_output(scheduler_output, future.result(), start)

    def _process_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, start: float
    ) -> list[RequestOutput]:
        """Advance the bookkeeping past a step that ran, append its tokens, retire the
        requests that stopped, and report every request that made progress."""
        now = self.clock()
        self.scheduler.update_from_output(scheduler_output, runner_output)

        outputs = []
        num_prompt_tokens = num_generation_tokens = 0
        beam_group_of = self.beam_groups.group_of
        structured_requests = self.structured_output.requests
        sampled_token_ids = runner_output.sampled_token_ids
        has_logprobs = bool(runner_output.logprobs or runner_output.prompt_logprobs)
        for seq in scheduler_output.scheduled_seqs:
            if seq.is_finished:  # async: stopped or aborted after this step was scheduled
                continue
            if beam_group_of and seq.request_id in beam_group_of:  # its group decides
                rows = runner_output.logprobs.get(seq.request_id)
                if rows and beam_group_of[seq.request_id].record(seq, rows[0]):
                    # One token generated for this beam (vLLM counts each beam's step as
                    # a one-token request); the first row ends the prompt's prefill.
                    num_generation_tokens += 1
                    if seq.num_output_tokens == 0:
                        num_prompt_tokens += seq.num_prompt_tokens
                continue
            new_tokens = sampled_token_ids.get(seq.request_id, ())
            num_before = seq.num_output_tokens
            if has_logprobs:
                self.output_processor.record_logprobs(seq, runner_output)
            stop = self.output_processor.append_tokens(seq, new_tokens, now)
            num_new = seq.num_output_tokens - num_before  # a stop drops the tokens after it
            if structured_requests and seq.request_id in structured_requests:
                stop = self._advance_grammar(seq, num_new, stop)
            if num_before == 0 and num_new:  # its prefill is complete
                num_prompt_tokens += seq.num_prompt_tokens
            num_generation_tokens += num_new
            if stop is not None:
                self.scheduler.finish_requests(seq.request_id, stop.reason, stop.stop_reason)
            output = self.output_processor.make_output(seq)
            if output is not None:
                outputs.append(output)
        if self.beam_groups.groups:
            outputs += self._advance_beam_search(now)
        self.last_stats = self.make_stats(
            scheduler_output, start, self.clock(), num_prompt_tokens, num_generation_tokens
        )
        if self.step_log is not None:
            self.step_log.append(self.last_stats)
        return self.parent_requests.gather(outputs)

    def _advance_grammar(self, seq, num_new: int, stop: StopDecision | None) -> StopDecision | None:
        """Structured outputs: the request's matcher takes the tokens it got; a complete
        output stops the request (even with ``ignore_eos``)."""
        new_tokens = seq.output_token_ids[len(seq.output_token_ids) - num_new :] if num_new else []
        terminated = self.structured_output.accept_tokens(seq.request_id, new_tokens)
        if stop is None and terminated:
            stop = StopDecision(FinishReason.STOP)
        if stop is not None:
            self.structured_output.remove(seq.request_id)
        return stop

    def _advance_beam_search(self, now: float) -> list[RequestOutput]:
        """Each beam-search request whose beams have all reported picks its next beams
        (beam_search.py); the scheduler finishes the dropped ones and makes the forks.
        Returns the requests whose search is over."""
        outputs = []
        for group in [g for g in self.beam_groups.groups.values() if g.ready]:
            step = group.step(now)
            self.beam_groups.update_beams(group, step)
            if step.dropped:  # pruned: nobody reports them
                ids = [seq.request_id for seq in step.dropped]
                self.scheduler.finish_requests(ids, FinishReason.ABORT)
            for parent, child in step.forks:
                self.scheduler.fork_request(parent, child)
            if group.finished:
                self.beam_groups.pop(group.request_id)
                outputs.append(group.make_output(self.model_info.tokenizer))
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and the hit-rate counters (like vLLM's), e.g. between
        benchmark runs. Returns False, doing nothing, while requests are in flight."""
        return self.kv_cache_manager.reset_prefix_cache()

    # --- introspection -------------------------------------------------------------------

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters since the engine started (vLLM's
        ``SpecDecodingStats``), or None when speculation is off."""
        if self.config.speculative_config is None:
            return None
        return self.scheduler.spec_decoding_stats

    def make_stats(
        self,
        scheduler_output: SchedulerOutput | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
    ) -> StepStats:
        """The snapshot `step` records after each step; called with no step, the engine's
        queues, KV pool and counters as they are now (vLLM's ``Scheduler.make_stats``)."""
        now = self.clock() if start_time is None else start_time
        return StepStats.capture(
            self.scheduler, self.kv_cache_manager, self.spec_decoding_stats,
            scheduler_output, now, now if end_time is None else end_time,
            num_prompt_tokens, num_generation_tokens,
        )  # fmt: skip

    def stats(self) -> dict:
        """`make_stats` as a dict, with the config, e.g. for a progress display."""
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
            "config": asdict(self.config),
        }
