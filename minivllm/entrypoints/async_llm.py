"""`AsyncLLM`: the engine behind an asyncio server (vLLM's ``AsyncLLM``, in one process).

`LLMEngine` is synchronous and not thread-safe, and one step is 10-500 ms of CPU work, so
it cannot run on the event loop. Instead one background thread owns the engine:

    event loop (HTTP handlers)              engine thread
    --------------------------              -------------
    add_request() ── command queue ──────▶  apply adds / aborts between two steps
                                            step() while work exists, else sleep on an Event
    RequestStream ◀── call_soon_threadsafe ─ each RequestOutput to its request's queue

A request that arrives while a step runs waits in the command queue and joins the batch
at the next step: continuous batching, online. Everything that touches the engine runs on
the engine thread. Tokenizing a prompt runs on a third thread, the tokenizer thread
(`run_on_tokenizer_thread`): on the event loop it would stop every stream, on the engine
thread every step. (Hugging Face's fast tokenizers release the GIL while they encode.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from minivllm.engine import LLMEngine, Prompt
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.stats import StepStats

logger = logging.getLogger("minivllm.serve")

T = TypeVar("T")
PromptFactory = Callable[[], Prompt]  # builds the engine prompt on the engine thread


class RequestFailedError(RuntimeError):
    """One request failed inside a step (the engine's finish_reason "error"); the engine
    and the other requests go on. The server answers 500."""

    def __init__(self, error: str) -> None:
        super().__init__(f"the engine failed on this request: {error}")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served (vLLM's
    ``EngineDeadError``: the server answers 503, /health included)."""


@dataclass
class StepRecord:
    """One engine step as the live page and /metrics see it (a numbered `StepStats`)."""

    index: int
    stats: StepStats


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Leaving the iteration early (the client went away, the handler was cancelled) aborts
    the request in the engine at once, which frees its KV blocks."""

    def __init__(self, request_id: str, async_llm: AsyncLLM) -> None:
        self.request_id = request_id
        self._async_llm = async_llm
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()  # the event loop its consumer runs on
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's event loop."""
        self._queue.put_nowait(item)

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        """Called by the engine thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            self.loop.call_soon_threadsafe(self.put, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # cancelled or closed early: free the engine's resources
                self._async_llm.abort(self.request_id)

    async def collect(self) -> RequestOutput:
        """Wait for the end and return the last output (for FINAL_ONLY requests)."""
        last = None
        async for output in self:
            last = output
        return last


class AsyncLLM:
    """Serve an `LLMEngine` to many concurrent asyncio callers; see the module docstring.

    ``step_listeners`` are called on the engine thread after every step with the step's
    `StepRecord` and its outputs (the metrics use this); ``abort_listeners`` with the id
    of each request that was aborted; ``error_listeners`` with the id of each request
    that ended with an error. A listener that raises is logged, not fatal.

    An exception out of ``engine.step()`` is fatal, as in vLLM (the engine's state is
    suspect, an executor may have lost a worker): every request in flight ends with an
    `EngineDeadError` under the id its caller waits on (an ``n > 1`` parent, a beam
    search), the thread stops (no retry loop, one logged traceback), and from then on
    `is_alive` is False (/health answers 503) and every new request is refused."""

    def __init__(self, engine: LLMEngine, step_history: int = 300) -> None:
        self.engine = engine
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size  # for /detokenize
        self.recent_steps: deque[StepRecord] = deque(maxlen=step_history)  # for the live page
        self.step_listeners: list[Callable[[StepRecord, list[RequestOutput]], None]] = []
        self.abort_listeners: list[Callable[[str], None]] = []
        self.error_listeners: list[Callable[[str], None]] = []
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_up = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_steps = 0
        self._stopping = False
        self.dead_error: EngineDeadError | None = None  # why the engine died, once it has
        # Graceful shutdown: no new requests; the engine aborts what is left at the deadline.
        self._accepting = True
        self._drain_deadline: float | None = None  # time.monotonic()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()
        # One thread: prompts are tokenized one at a time, in arrival order.
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="minivllm-tokenizer"
        )
        self.max_chars_per_token = _max_chars_per_token(engine.get_tokenizer())

    # --- the event-loop side ---------------------------------------------------------------

    async def run_on_tokenizer_thread(self, function: Callable[[], T]) -> T:
        """``function()`` (which tokenizes a prompt, or decodes ids) on the tokenizer
        thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, function)

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt | PromptFactory,
        params: SamplingParams | BeamSearchParams,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it. A bad prompt raises the
        engine's ValueError here, before any output (so a server can still answer 400).

        ``prompt`` may also be a function, called on the engine thread between two steps
        (cheap work only: the server tokenizes on the tokenizer thread first, see
        `run_on_tokenizer_thread`, and passes token ids). After `begin_shutdown` every
        request is refused with EngineDeadError (a 503)."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        stream = RequestStream(request_id, self)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def add() -> None:
            if self.dead_error is not None:  # it died while this command was queued
                _resolve(accepted, EngineDeadError(str(self.dead_error)))
                return
            try:
                engine_prompt = prompt() if callable(prompt) else prompt
                if isinstance(params, BeamSearchParams):  # reported once, finished
                    self.engine.add_beam_search_request(request_id, engine_prompt, params)
                else:
                    self.engine.add_request(request_id, engine_prompt, params)
            except Exception as e:  # bad input fails this request only
                _resolve(accepted, e)
                return
            self._streams[request_id] = stream
            _resolve(accepted, None)

        self._submit(add)
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine saw the request
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: Prompt | PromptFactory, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: add the request, then yield its outputs."""
        stream = await self.add_request(request_id, prompt, params)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request at the next gap between steps (safe from any thread)."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            if self.dead_error is None and self.engine.abort_request(request_id):
                for listener in self.abort_listeners:
                    _call_logged(listener, request_id)

        self._submit(abort)

    @property
    def tokenizer(self):
        """The engine's tokenizer, for the tokenizer thread and prompt functions."""
        return self.engine.get_tokenizer()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.dead_error is None

    @property
    def num_steps(self) -> int:
        return self._num_steps

    def begin_shutdown(self, grace_period: float) -> None:
        """Graceful shutdown: refuse new requests from now on; the ones in flight may
        finish for ``grace_period`` seconds, then each is aborted and its stream ends with
        an EngineDeadError. Safe from any thread, and from a signal handler: it only sets
        attributes, which the engine thread reads after every step."""
        self._accepting = False
        self._drain_deadline = time.monotonic() + grace_period

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished requests end with an
        EngineDeadError."""
        self._stopping = True
        self._wake_up.set()
        self._thread.join(timeout)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake_up.set()

    # --- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            # Clear before draining: a command queued after the drain sets the event again,
            # so the wait below cannot miss it.
            self._wake_up.clear()
            self._apply_commands()
            if self.dead_error is not None:  # dead: only answer commands, never step again
                self._wake_up.wait()
                continue
            deadline = self._drain_deadline
            if deadline is not None and time.monotonic() >= deadline and self._streams:
                self._fail_all(EngineDeadError("the server shut down before this request finished"))
            # Async scheduling leaves a step in flight after the last request is done:
            # report it now, or the next request's first step would report it.
            if not engine.has_unfinished_requests() and engine.in_flight is None:
                self._wake_up.wait()  # idle: sleep, no busy loop
                continue
            self._step()
        if self.dead_error is None:
            self._fail_all(EngineDeadError("the server is shutting down"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            _call_logged(command)

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:
            self._die(e)
            return
        # A request that failed alone in the step (finish_reason "error") ends with an
        # error for its caller; the others go on.
        failed = [o for o in outputs if o.error is not None]
        if failed:
            outputs = [o for o in outputs if o.error is None]
        if engine.last_stats is not None:  # the step ran: the engine's snapshot of it
            self._num_steps += 1
            record = StepRecord(self._num_steps, engine.last_stats)
            self.recent_steps.append(record)
            for listener in self.step_listeners:
                _call_logged(listener, record, outputs)
        # One wake-up of the event loop per step, not one per output.
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its caller while this step ran
            deliveries.append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
        _deliver_threadsafe(deliveries)
        for output in failed:
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put_threadsafe(RequestFailedError(output.error))
            for listener in self.error_listeners:
                _call_logged(listener, output.request_id)

    def _die(self, error: Exception) -> None:
        """A step raised: the engine is dead (see the class docstring). Each stream is
        keyed by the id its caller waits on, so ending every stream reaches ``n > 1``
        parents and beam searches too, not only the ids the step scheduled."""
        logger.error("engine step failed; the engine is dead:\n%s", traceback.format_exc())
        self.dead_error = EngineDeadError(
            f"the engine died ({type(error).__name__}: {error}); restart the server"
        )
        for request_id, stream in self._streams.items():
            stream.put_threadsafe(self.dead_error)
            for listener in self.error_listeners:
                _call_logged(listener, request_id)
        self._streams.clear()
        self._wake_up.set()

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            if self.engine.abort_request(request_id):
                for listener in self.abort_listeners:
                    _call_logged(listener, request_id)
            stream.put_threadsafe(error)
        self._streams.clear()


def _max_chars_per_token(tokenizer) -> int:
    """The longest token's length in characters: a text of ``n`` characters has at least
    ``n / max_chars_per_token`` tokens (for tokenizers whose tokens spell out their text,
    as byte-level BPE's do). 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    return max(1, max(map(len, tokenizer.get_vocab())))


def _call_logged(function: Callable, *args) -> None:
    """Run a command or listener on the engine thread; a bug in one must not stop it."""
    try:
        function(*args)
    except Exception:
        logger.exception("error on the engine thread (the loop goes on)")


def _deliver_threadsafe(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hand each output to its stream, with one call into each event loop involved."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, output in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream, output))
    for loop, items in by_loop.items():

        def deliver(items=items) -> None:
            for stream, output in items:
                stream.put(output)

        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            loop.call_soon_threadsafe(deliver)


def _resolve(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    """Complete an event-loop future from the engine thread."""

    def set_() -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    future.get_loop().call_soon_threadsafe(set_)
