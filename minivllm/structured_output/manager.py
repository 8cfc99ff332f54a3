"""Per-request grammar state inside the continuous batch (vLLM's ``StructuredOutputManager``,
vllm/v1/structured_output/__init__.py).

A request with ``structured_outputs`` lives here beside the scheduler:

1. `add_request`: its constraint is compiled on the compile thread, once per distinct
   constraint (a cache keyed by it: the same schema again is a cache hit). Until then
   the request is *waiting for its grammar* (vLLM's ``WAITING_FOR_FSM``): the engine
   does not hand it to the scheduler, and every other request keeps stepping.
2. `take_ready`: the requests whose grammar is ready, each with its own matcher.
3. Each step, `grammar_bitmask`: one bitmask row per sampled row of a constrained request
   (its last row, and with draft tokens one per draft: the matcher walks through the
   drafts, filling the mask at each, then rolls back). The model runner applies it to
   exactly those rows of the logits before sampling (sampler.py, `apply_grammar_bitmask`).
4. `accept_tokens`: after the step, the tokens the request really got (a rejected
   draft never reaches the matcher). True when the grammar is complete.

A request without ``structured_outputs`` never enters: the engine's one check per step is
whether `requests` is empty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import Sequence
from minivllm.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    StructuredOutputBackend,
    bitmask_words,
)

logger = logging.getLogger("minivllm.structured_output")


@dataclass
class GrammarBitmask:
    """The masks of one step: ``bitmask[i]`` applies to sampled row ``rows[i]`` (rows
    numbered as the model runner samples them: each sampling chunk in order, ``1 +
    num_draft_tokens`` rows each). Rows not listed are not masked."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words], int32


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
        self.stats = StructuredOutputStats()

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
            ready.append(seq)
        return ready, failed

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled (for a step with nothing else to do)."""
        if self.waiting:
            wait([f for _, f in self.waiting.values()], timeout, FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.waiting.pop(request_id, None)

    def shutdown(self) -> None:
        if self.compile_thread is not None:
            self.compile_thread.shutdown(wait=False, cancel_futures=True)

    # --- the step ------------------------------------------------------------------------

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The masks for this step's sampled rows of constrained requests, or None if no
        constrained request samples in it. Row numbering follows the model runner."""
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
