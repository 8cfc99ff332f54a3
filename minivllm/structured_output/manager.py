"""Per-request grammar state inside the continuous batch (vLLM's ``StructuredOutputManager``,
vllm/v1/structured_output/__init__.py).

A request with ``structured_outputs`` lives here beside the scheduler. The engine calls
this manager at five fixed places, each one line (engine.py):

1. `hold` (when a request is queued): its constraint is compiled on the compile thread,
   once per distinct constraint (a cache keyed by it: the same schema again is a cache
   hit). Until then the request is *waiting for its grammar* (vLLM's
   ``WAITING_FOR_FSM``): it is not in the scheduler, and every other request keeps stepping.
2. `admit_ready` (before a step): the requests whose grammar is ready join the
   scheduler's waiting queue, each with its own matcher.
3. `grammar_bitmask` (after scheduling): one bitmask row per sampled row of a constrained
   request (its last row, and with draft tokens one per draft: the matcher walks through
   the drafts, filling the mask at each, then rolls back). The model runner applies it to
   exactly those rows of the logits before sampling (sampler.py, `apply_grammar_bitmask`).
4. `advance` (after the step): the matcher takes the tokens the request really got (a
   rejected draft never reaches it). True when the output is complete: the request stops.
5. `abort`.
While a constrained request is in flight, steps do not overlap (`pauses_overlap`).

A request without ``structured_outputs`` never enters: each place above first checks
whether `requests` (or `waiting`) is empty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.scheduler_output import GrammarBitmask, SchedulerOutput
from minivllm.sequence import FinishReason, Sequence
from minivllm.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    StructuredOutputBackend,
    bitmask_words,
)

logger = logging.getLogger("minivllm.structured_output")


@dataclass
class StructuredOutputStats:
    """Where the CPU time goes (thread CPU seconds) and what the cache saved."""

    num_compiles: int = 0
    num_cache_hits: int = 0
    compile_s: list[float] = field(default_factory=list)  # per compile, on its thread
    mask_fill_s: float = 0.0  # filling the bitmask rows, summed over steps
    advance_s: float = 0.0  # accepting sampled tokens, summed over steps
    num_masked_rows: int = 0


def _make_guidance_backend(tokenizer, vocab_size: int) -> StructuredOutputBackend:
    from minivllm.structured_output.guidance import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """ValueError naming the field if the constraint cannot compile (no tokenizer needed)."""
    try:
        from minivllm.structured_output.guidance import validate
    except ImportError as e:  # pragma: no cover - the [structured] extra is not installed
        raise ValueError(
            "structured_outputs needs llguidance: pip install 'minivllm[structured]'"
        ) from e
    validate(params)


class StructuredOutputManager:
    """``make_backend(tokenizer, vocab_size)``: the grammar library (llguidance by
    default); built on the compile thread when the first constrained request comes, so an
    engine that never sees one never pays for it."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        make_backend: Callable[..., StructuredOutputBackend] = _make_guidance_backend,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.make_backend = make_backend
        self.backend: StructuredOutputBackend | None = None
        self.compile_thread: ThreadPoolExecutor | None = None
        self.cache: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self.waiting: dict[str, tuple[Sequence, Future[CompiledGrammar]]] = {}
        self.requests: dict[str, Grammar] = {}  # admitted: each its own matcher
        self.num_accepted: dict[str, int] = {}  # output tokens each matcher has taken
        self.stats = StructuredOutputStats()
        self.said_overlap_paused = False

    # --- the engine's five calls ---------------------------------------------------------

    def check(self, params, scheduling_policy: str) -> None:
        """A request's constraint (``params``: its `SamplingParams`, if any) that cannot
        compile, or a setting it cannot work with, raises ValueError naming the field,
        before anything is queued."""
        params = getattr(params, "structured_outputs", None)
        if params is None:
            return
        if scheduling_policy != "continuous":
            raise ValueError("structured_outputs needs the continuous scheduling policy")
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer")
        validate_structured_outputs(params)

    def hold(self, seq: Sequence) -> bool:
        """Take ``seq`` if it asks for structured outputs (it waits here for its grammar);
        False, doing nothing, if it does not."""
        if seq.sampling_params.structured_outputs is None:
            return False
        self.add_request(seq)
        return True

    def admit_ready(self, scheduler) -> list[tuple[Sequence, Exception]]:
        """Hand the requests whose grammar is compiled to ``scheduler`` (vLLM's
        ``WAITING_FOR_FSM`` -> ``WAITING``), in the order they came; return those whose
        compile failed, with the error. With nothing else to run, wait a moment first."""
        if not scheduler.has_unfinished_requests():
            self.wait_for_compile(timeout=0.05)
        ready, failed = self.take_ready()
        for seq in ready:
            scheduler.add_request(seq)
        return failed

    def advance(self, seq: Sequence, stopped: bool) -> bool:
        """After a step: ``seq``'s matcher takes the output tokens it got since it last
        advanced. True when the output is complete (the engine stops the request then,
        even with ``ignore_eos``). A request that stops (``stopped``, or complete) leaves."""
        request_id = seq.request_id
        if request_id not in self.requests:
            return False
        new_tokens = seq.token_ids[seq.num_prompt_tokens + self.num_accepted[request_id] :]
        self.num_accepted[request_id] = seq.num_output_tokens
        complete = self.accept_tokens(request_id, new_tokens)
        if stopped or complete:
            self.remove(request_id)
        return complete

    def abort(self, request_id: str, now: float) -> bool:
        """Forget ``request_id``. True if it was still waiting for its grammar (it never
        reached the scheduler: it is finished here)."""
        held = self.waiting.get(request_id)
        self.remove(request_id)
        if held is not None:
            held[0].finish(FinishReason.ABORT, now)
        return held is not None

    def pauses_overlap(self) -> bool:
        """Whether steps must not overlap now: a constrained request's next mask depends
        on the token the step before samples. Said once in the log."""
        if not self.requests:
            return False
        if not self.said_overlap_paused:
            logger.info(
                "async scheduling paused while structured-output requests are in flight: "
                "each one's next mask depends on the token the step before samples"
            )
            self.said_overlap_paused = True
        return True

    # --- requests in and out -------------------------------------------------------------

    def add_request(self, seq: Sequence) -> None:
        """Queue ``seq``'s grammar for compiling (or find it in the cache)."""
        params = seq.sampling_params.structured_outputs
        key = params.key
        future = self.cache.get(key)
        if future is None:
            if self.compile_thread is None:
                self.compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            future = self.compile_thread.submit(self._compile, params)
            self.cache[key] = future
        else:
            self.stats.num_cache_hits += 1
        self.waiting[seq.request_id] = (seq, future)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """On the compile thread (so the backend is built there too, once)."""
        if self.backend is None:
            self.backend = self.make_backend(self.tokenizer, self.vocab_size)
        start = time.thread_time()
        compiled = self.backend.compile(params)
        self.stats.compile_s.append(time.thread_time() - start)
        self.stats.num_compiles += 1
        return compiled

    def take_ready(self) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """The waiting requests whose grammar is compiled, in the order they came, now
        holding their own matcher; and those whose compile failed, with the error."""
        ready, failed = [], []
        for request_id, (seq, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[request_id]
            error = future.exception()
            if error is not None:
                failed.append((seq, error))
                continue
            self.requests[request_id] = future.result().new_matcher()
            self.num_accepted[request_id] = seq.num_output_tokens
            ready.append(seq)
        return ready, failed

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled (for a step with nothing else to do)."""
        if self.waiting:
            wait([f for _, f in self.waiting.values()], timeout, FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.num_accepted.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def shutdown(self) -> None:
        if self.compile_thread is not None:
            self.compile_thread.shutdown(wait=False, cancel_futures=True)

    # --- the step ------------------------------------------------------------------------

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The masks for this step's sampled rows of constrained requests, or None if no
        constrained request samples in it. Row numbering follows the model runner."""
        if not self.requests:
            return None
        start = time.thread_time()
        to_fill: list[tuple[Grammar, int, list[int]]] = []
        row = 0
        for chunk in scheduler_output.chunks:
            if not chunk.sample:
                continue
            grammar = self.requests.get(chunk.request_id)
            if grammar is not None:
                to_fill.append((grammar, row, chunk.draft_token_ids))
            row += 1 + chunk.num_draft_tokens
        if not to_fill:
            return None
        rows = [first + j for _, first, drafts in to_fill for j in range(1 + len(drafts))]
        bitmask = torch.full((len(rows), bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        index = 0
        for grammar, _, drafts in to_fill:
            index = self._fill_rows(grammar, drafts, bitmask, index)
        self.stats.mask_fill_s += time.thread_time() - start
        self.stats.num_masked_rows += len(rows)
        return GrammarBitmask(rows, bitmask)

    @staticmethod
    def _fill_rows(grammar: Grammar, drafts: list[int], bitmask: torch.Tensor, index: int) -> int:
        """Row ``index`` gets the mask of the grammar as it is; with drafts, row ``index +
        j + 1`` the mask after drafts ``0..j``. A draft the grammar refuses is rejected by
        the sampler at its own row (its probability there is 0), so the rows after it are
        never used and keep their "anything" mask. The matcher ends where it began."""
        grammar.fill_bitmask(bitmask, index)
        advanced = 0
        for j, token in enumerate(drafts):
            if grammar.is_terminated() or not grammar.accept_tokens([token]):
                break
            advanced += 1
            grammar.fill_bitmask(bitmask, index + j + 1)
        grammar.rollback(advanced)
        return index + 1 + len(drafts)

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance ``request_id``'s matcher past the tokens it got this step; True when
        its output is complete: it ends with EOS, which the grammar allowed. (The engine
        stops the request then, even with ``ignore_eos``; without it, EOS stops it anyway.
        Stopping as soon as nothing but EOS is allowed would make the tokens depend on
        whether that EOS came in the same step as the last character, as drafts allow.)"""
        grammar = self.requests.get(request_id)
        if grammar is None or not token_ids:
            return False
        start = time.thread_time()
        # A matcher that is complete takes nothing more, EOS included (llguidance reads
        # "stopped" as "EOS is implied"): EOS is accepted only where it is still open.
        eos = self.tokenizer.eos_token_id
        ends_with_eos = token_ids[-1] == eos
        body = token_ids[:-1] if ends_with_eos else token_ids
        ok = grammar.accept_tokens(body) if body else True
        if ok and ends_with_eos and not grammar.is_terminated():
            ok = grammar.accept_tokens([eos])
        self.stats.advance_s += time.thread_time() - start
        if not ok:  # cannot happen when the mask was applied
            logger.error("request %s: tokens %s refused by its grammar", request_id, token_ids)
            return True
        return ends_with_eos
