"""``minivllm serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn.

Routes (vLLM's shapes): POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
GET /v1/models, POST /tokenize and /detokenize, /health, /ping, /version, /metrics
(Prometheus, vLLM's names), and the live page GET / with its data at GET /live/state. Bad
input is a 400 (404 for an unknown model) with ``{"error": {"message", "type", "param",
"code"}}``. With ``--api-key``, as in vLLM, the ``/v1/*`` routes ask for it
(``Authorization: Bearer KEY``; else a 401), and /live/state shows prompts and outputs
only to a caller with it (see `_require_api_key` for what stays open and why).

    python -m minivllm.entrypoints.openai.api_server --port 8000 [engine options]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import secrets
import signal
import socket
import threading
import time
from typing import Any

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine import LLMEngine
from minivllm.entrypoints.async_llm import AsyncLLM
from minivllm.entrypoints.live import PAGE, LiveRequests, live_state
from minivllm.entrypoints.openai.errors import error_body, error_from_exception
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from minivllm.entrypoints.openai.serving import OpenAIServing
from minivllm.entrypoints.prometheus import ServerMetrics
from minivllm.entrypoints.stats_logger import LoggingStatLogger, startup_summary
from minivllm.models.model_files import HUB_ID
from minivllm.utils import freeze_gc_heap

logger = logging.getLogger("minivllm.serve")

try:
    VERSION = importlib.metadata.version("minivllm")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "0.1.0"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds in-flight requests get to finish on SIGTERM


def build_app(
    async_llm: AsyncLLM, model_name: str | list[str], api_key: str | None = None
) -> FastAPI:
    """The FastAPI app serving ``async_llm`` under ``model_name`` (or several names, the
    first one used in replies and metrics, as vLLM's ``--served-model-name``). The caller
    owns the
    `AsyncLLM` (and shuts it down). With ``api_key``, the ``/v1/*`` routes answer 401
    unless the request carries ``Authorization: Bearer <api_key>``."""
    prometheus_client.disable_created_metrics()  # no `_created` series, as in vLLM
    live = LiveRequests(start_time=time.perf_counter(), engine=async_llm.engine)
    model_names = [model_name] if isinstance(model_name, str) else list(model_name)
    serving = OpenAIServing(async_llm, model_names, live)
    # Called on the engine thread; setting one attribute of a listed request is safe there.
    async_llm.abort_listeners.append(lambda request_id: live.fail(request_id, "abort"))
    async_llm.error_listeners.append(lambda request_id: live.fail(request_id, "error"))
    async_llm.step_listeners.append(live.on_step)
    metrics = ServerMetrics(async_llm, model_names[0])
    app = FastAPI(title="minivllm", version=VERSION)
    app.state.async_llm = async_llm
    if api_key is not None:
        _require_api_key(app, api_key)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI and vLLM answer 400 naming the field.
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            return JSONResponse(error_body("the body is not valid JSON", 400), status_code=400)
        fields = [".".join(str(p) for p in e["loc"] if p != "body") or "body" for e in errors]
        message = "; ".join(
            f"{field} is not supported by minivllm"
            if e["type"] == "extra_forbidden"  # a field no model here declares
            else f"{field}: {e['msg']}"
            for field, e in zip(fields, errors)
        )
        param = fields[0].split(".")[0] if fields else None
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own errors (a body it cannot parse, e.g. JSON nested too deep for the
        # parser; an unknown route or method) in the same shape as every other error.
        message = str(exc.detail)
        if message == "There was an error parsing the body":
            message = "the body could not be parsed as JSON (malformed, or nested too deep)"
        body = error_body(message, exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await _respond(raw, serving.create_completion(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(raw, serving.create_chat_completion(request))

    # vLLM's tokenizer routes, outside /v1 (so, as in vLLM, --api-key leaves them open).
    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any], raw: Request) -> Response:
        return await _respond(raw, serving.create_tokenize(_tokenize_request(body)))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw: Request) -> Response:
        return await _respond(raw, serving.create_detokenize(request))

    @app.get("/v1/models")
    async def models() -> ModelList:
        root, max_len = model_names[0], async_llm.max_model_len
        cards = [ModelCard(id=name, root=root, max_model_len=max_len) for name in model_names]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_llm.is_alive else 503)

    @app.get("/ping")  # vLLM's alias of /health (the SageMaker convention)
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def live_page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/live/state")
    async def live_data(raw: Request, since: int = 0) -> dict:
        # Other clients' prompts and outputs: only for a caller with the key, if one is set.
        redact = api_key is not None and not _has_api_key(raw, api_key)
        return live_state(async_llm, live, since, redact=redact)

    return app


def _tokenize_request(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two forms of ``/tokenize``: ``messages`` makes it the chat form. Chosen
    here, not by a pydantic union, so a bad field is named alone (a union's error names
    each form it tried). Errors go to the app's validation handler, as a body's do."""
    if "messages" in body and "prompt" in body:
        message = "send prompt (text) or messages (chat), not both"
        raise RequestValidationError([{"type": "value_error", "loc": ("prompt",), "msg": message}])
    form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return form.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """vLLM's --api-key: the OpenAI routes need the key. /health, /ping, /metrics and
    /version stay open (a load balancer or scraper has no key; they hold counts, no
    text), as do /tokenize and /detokenize (as in vLLM: they only transform what the
    caller sends). The live page is static HTML; its data, /live/state, blanks every
    prompt and output for a caller without the key (`live_state`)."""

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        is_api = request.url.path.startswith("/v1/") or request.url.path == "/v1"
        if is_api and request.method != "OPTIONS" and not _has_api_key(request, api_key):
            message = "Incorrect or missing API key: send Authorization: Bearer <key>"
            return JSONResponse(error_body(message, 401), status_code=401)
        return await call_next(request)


def _has_api_key(request: Request, api_key: str) -> bool:
    given = request.headers.get("authorization", "")
    return secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode())


async def _respond(raw: Request, work) -> Response:
    """Run a route's work; turn its result or exception into the HTTP response.

    A plain response is awaited while watching the connection: if the client goes away
    first, the work is cancelled, which aborts its engine request (vLLM's
    ``with_cancellation``). A stream's disconnects are seen by Starlette itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (the server is stopping)
        watcher.cancel()
        if not task.done():
            task.cancel()  # its request stream aborts the engine request
    if not task.done():
        return Response(status_code=499)  # nobody is listening any more
    try:
        result = task.result()
    except Exception as e:
        status, body = error_from_exception(e)
        return JSONResponse(body, status_code=status)
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


async def _client_gone(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# --- running it ---------------------------------------------------------------------------


def serve(
    engine: LLMEngine,
    host: str,
    port: int,
    model_name: str | list[str],
    log_level="info",
    api_key: str | None = None,
    log_stats: bool = True,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully and return.

    On the signal uvicorn stops accepting connections and waits for the open ones; the
    engine refuses new requests, lets those in flight run for ``shutdown_timeout``
    seconds, then aborts the rest: each stream ends with an error event, each plain
    request gets a 503. So every client hears how its request ended, and uvicorn never
    has to cancel a handler (which would print a traceback per request). uvicorn then
    re-raises the signal; the handlers below turn that into a normal return."""
    async_llm = AsyncLLM(engine)
    app = build_app(async_llm, model_name, api_key)
    names = [model_name] if isinstance(model_name, str) else model_name
    for line in startup_summary(engine, ", ".join(names), f"http://{host}:{port}"):
        logger.info(line)
    if log_stats:
        LoggingStatLogger(async_llm)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # A backstop only: the engine has ended every request by then.
        timeout_graceful_shutdown=shutdown_timeout + 5,
    )
    previous = signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        _GracefulServer(config, async_llm, shutdown_timeout).run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        async_llm.shutdown()


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, which also starts the engine's graceful shutdown on a signal."""

    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM, grace_period: float):
        super().__init__(config)
        self.async_llm = async_llm
        self.grace_period = grace_period

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info(
                "shutting down: %d request(s) in flight get %.0f s to finish",
                self.async_llm.num_in_flight,
                self.grace_period,
            )
            self.async_llm.begin_shutdown(self.grace_period)
        super().handle_exit(sig, frame)


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)


class BackgroundServer:
    """A server on a background thread of this process, e.g. in a notebook or a test:

        with BackgroundServer(engine) as server:
            httpx.get(server.url + "/health")

    Listens on ``host`` and a free port the OS picks (unless ``port`` is given)."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str | list[str] = DEFAULT_MODEL_NAME,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.async_llm = AsyncLLM(engine)
        self.app = build_app(self.async_llm, model_name)
        self._socket = socket.create_server((host, port))
        bound_host, bound_port = self._socket.getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
        self.async_llm.shutdown()


def served_names(model: str | None) -> list[str]:
    """The names a client may send as ``model`` when no --served-model-name is given: the
    --model argument, as in vLLM; for the bundled model both its short name and its Hub id
    (what a vLLM user types), the one given first."""
    bundled = [DEFAULT_MODEL_NAME, HUB_ID]
    if model is None or model in bundled:
        return sorted(bundled, key=lambda name: name != (model or DEFAULT_MODEL_NAME))
    return [model]


def run_serve(args: argparse.Namespace, engine_config) -> int:
    """The ``serve`` subcommand, given its parsed arguments and the `EngineConfig`."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(message)s")
    engine = LLMEngine(engine_config)
    freeze_gc_heap()  # the start-up objects stay out of the collector's passes, as in vLLM
    model_name = args.served_model_name or served_names(engine_config.model)
    try:
        serve(
            engine,
            args.host,
            args.port,
            model_name,
            args.log_level,
            api_key=args.api_key,
            log_stats=not args.disable_log_stats,
            shutdown_timeout=args.shutdown_timeout,
        )
    finally:
        engine.close()  # tensor-parallel workers leave with the server
    return 0


def main(argv: list[str] | None = None) -> int:
    from minivllm.entrypoints import cli_args
    from minivllm.entrypoints.openai.cli_args import add_server_arguments

    parser = argparse.ArgumentParser(
        description="minivllm's OpenAI-compatible server",
        formatter_class=cli_args.DefaultsHelpFormatter,
    )
    add_server_arguments(parser)
    cli_args.add_engine_args(parser)
    args = parser.parse_args(argv)
    try:
        config = cli_args.engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run_serve(args, config)


if __name__ == "__main__":
    raise SystemExit(main())
