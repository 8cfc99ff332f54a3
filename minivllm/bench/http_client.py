"""The client side of ``minivllm bench --base-url``: a seeded workload sent to any
OpenAI-compatible server (``minivllm serve``, a real ``vllm serve``), timed from the stream
the way ``vllm bench serve`` times it.

Each request is a streamed ``POST /v1/completions`` with the workload's prompt token ids,
``max_tokens`` = its output length, ``ignore_eos``, greedy, and
``stream_options.include_usage``. Requests start at their Poisson arrival times; with
``max_concurrency`` a client-side semaphore holds back the ones over the limit. Per request:

- TTFT: from just before the POST to the first event that has a choice;
- ITL: the gaps between later choice events (one event per token when the server sends
  one per token, as vLLM and minivllm do);
- e2e: to the last choice event; TPOT = (e2e - TTFT) / (output tokens - 1), with the
  output token count from the usage event.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from minivllm.bench.metrics import RequestResult, summarize
from minivllm.bench.runner import BenchRun
from minivllm.bench.workloads import BenchRequest, Workload
from minivllm.sequence import RequestMetrics


@dataclass
class StreamTiming(RequestMetrics):
    """`RequestMetrics` as a client sees them: ``token_times`` holds the arrival time of
    each streamed event, and TPOT divides by the server's token count (usage), not the
    number of events."""

    num_output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.finished_time is None or self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_latency - self.ttft) / (self.num_output_tokens - 1)


class RequestFailed(RuntimeError):
    pass


def run_http(
    base_url: str,
    workload: Workload,
    max_concurrency: int | None = None,
    progress: bool = True,
    model: str | None = None,
    name: str = "http",
) -> BenchRun:
    """Send ``workload`` to the server at ``base_url`` (e.g. ``http://127.0.0.1:8000``)
    after one short warm-up request; a run named ``name``, measured client-side.

    ``model`` defaults to the first model the server lists at /v1/models. Raises
    RequestFailed if any request fails (the table would otherwise compare unequal work)."""
    return asyncio.run(_run(base_url.rstrip("/"), workload, max_concurrency, progress, model, name))


async def _run(base_url, workload, max_concurrency, progress, model, name) -> BenchRun:
    # No connection limit or timeout: the workload's own concurrency is what is measured.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None) as client:
        model = model or await _first_model(client)
        warm_up = BenchRequest("warmup", workload.requests[0].prompt_token_ids[:32], 4)
        await _send(client, model, warm_up)

        semaphore = asyncio.Semaphore(max_concurrency or len(workload.requests))
        bar = tqdm(total=len(workload.requests), desc=f"{name} {base_url}", disable=not progress)
        start = time.perf_counter()

        async def arrive(request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + request.arrival_time - time.perf_counter()))
            async with semaphore:
                result = await _send(client, model, request)
            bar.update(1)
            return result

        results = await asyncio.gather(*(arrive(r) for r in workload.requests))
        duration = time.perf_counter() - start
        bar.close()
    return BenchRun(name, summarize(list(results), duration), list(results), start)


async def _first_model(client: httpx.AsyncClient) -> str:
    reply = await client.get("/v1/models")
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


async def _send(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    timing = StreamTiming(arrival_time=sent)
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            raise RequestFailed(f"{request.request_id}: HTTP {reply.status_code} {reply.text}")
        async for line in reply.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank separators, comments (":"), the end marker
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RequestFailed(f"{request.request_id}: {event['error']}")
            if event.get("choices"):
                if timing.first_token_time is None:
                    timing.first_token_time = now
                timing.token_times.append(now)
            elif event.get("usage"):
                usage = event["usage"]
    if not timing.token_times:
        raise RequestFailed(f"{request.request_id}: never received a valid chunk")
    timing.finished_time = timing.token_times[-1]
    num_prompt = usage["prompt_tokens"] if usage else len(request.prompt_token_ids)
    timing.num_output_tokens = usage["completion_tokens"] if usage else len(timing.token_times)
    return RequestResult(request.request_id, num_prompt, timing.num_output_tokens, timing)
