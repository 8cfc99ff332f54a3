"""A fault reaches every request that waits on it: when `engine.step()` raises (an
executor lost a worker, a bug), every request in flight — a plain one, a stream, an
``n > 1`` parent, a beam search — gets an error promptly under the id its client waits
on; the engine thread stops stepping (no retry loop, no log flood); /health answers 503
from then on (vLLM's EngineDeadError); new requests get a 503; the failed requests are
counted as ``finished_reason="error"``; and the server still stops cleanly. A real server
on 127.0.0.1 and a free port, its own engine (the fault kills it)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time

import httpx
import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.entrypoints.openai.api_server import BackgroundServer
from tests.helpers import ENGINE_OPTIONS, MODEL_NAME

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
REQUESTS = {
    "plain": {"prompt": "w1 w2", **LONG},
    "stream": {"prompt": "w3 w4", "stream": True, **LONG},
    "n2": {"prompt": "w5 w6", "n": 2, **LONG},
    "n2-stream": {"prompt": "w7", "n": 2, "stream": True, **LONG},
    "beams": {"prompt": "w8 w9", "n": 2, "use_beam_search": True, **LONG},
}


def _post(url: str, body: dict) -> tuple[int, dict]:
    """The status and the error a client sees (for a stream: the in-band error event)."""
    body = {"model": MODEL_NAME, **body}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as reply:
        if reply.status_code != 200:
            reply.read()
            return reply.status_code, reply.json()
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    if not body.get("stream"):
        return 200, json.loads(events[0])
    assert events[-1] == "[DONE]", events[-3:]
    return 200, json.loads(events[-2])


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_a_step_exception_fails_every_waiting_request_and_health_says_503(
    model_path, caplog, monkeypatch
):
    engine = LLMEngine(EngineConfig(model=str(model_path), **ENGINE_OPTIONS))
    real_step, armed, calls_after = engine.step, threading.Event(), []

    def step():
        if armed.is_set():
            calls_after.append(time.monotonic())
            raise RuntimeError("simulated executor death")
        time.sleep(0.02)  # slow enough that none finishes before all have started
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    caplog.set_level(logging.ERROR, logger="minivllm.serve")
    with BackgroundServer(engine, model_name=MODEL_NAME) as server:
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            futures = {k: pool.submit(_post, server.url, b) for k, b in REQUESTS.items()}
            deadline = time.monotonic() + 30
            while server.async_llm.num_in_flight < len(REQUESTS):
                assert time.monotonic() < deadline, "the requests did not all start"
                time.sleep(0.01)
            armed.set()
            start = time.monotonic()
            answers = {k: f.result(timeout=20) for k, f in futures.items()}
            elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed  # promptly, not at a client's timeout
        for name, (status, body) in answers.items():
            expected_status = 200 if REQUESTS[name].get("stream") else 503
            assert status == expected_status, (name, status, body)
            assert body["error"]["code"] == 503, (name, body)
            assert "simulated executor death" in body["error"]["message"], (name, body)
            assert body["error"]["type"] == "ServiceUnavailableError"
        time.sleep(0.3)
        assert len(calls_after) == 1  # the engine never stepped again: no spin
        failures = [r for r in caplog.records if "engine step failed" in r.getMessage()]
        assert len(failures) == 1  # one traceback, not one per loop
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.get(server.url + "/ping").status_code == 503
        status, body = _post(server.url, {"prompt": "w1", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == 503
        metrics = httpx.get(server.url + "/metrics").text
        assert _metric(metrics, "vllm:request_success_total", finished_reason="error") == 5
        assert _metric(metrics, "vllm:request_success_total", finished_reason="abort") == 0
        live = httpx.get(server.url + "/live/state").json()["requests"]
        assert sorted(r["status"] for r in live) == ["error"] * 5
        stop = time.monotonic()
    assert time.monotonic() - stop < 10  # a clean stop, not a backstop timeout
    assert not server._thread.is_alive()
    assert not server.async_llm._thread.is_alive()


@pytest.mark.slow  # two worker processes start (~10-40 s)
def test_a_killed_worker_fails_every_request_and_nothing_is_left(tiny_llama_path):
    """The issue's replay: tensor parallelism, SIGKILL one worker while a plain, an
    ``n = 2`` and a beam-search request run (and a stream): each gets its error within
    seconds, /health says 503, and the server stops with no worker left."""
    import os
    import signal

    import psutil

    options = ENGINE_OPTIONS | {"tensor_parallel_size": 2}
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), **options))
    pids = engine.executor.worker_pids
    requests = {k: v for k, v in REQUESTS.items() if k != "n2-stream"}
    try:
        with BackgroundServer(engine, model_name=MODEL_NAME) as server:
            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                futures = {k: pool.submit(_post, server.url, b) for k, b in requests.items()}
                deadline = time.monotonic() + 60
                while server.async_llm.num_in_flight < len(requests):
                    assert time.monotonic() < deadline, "the requests did not all start"
                    time.sleep(0.01)
                os.kill(pids[1], signal.SIGKILL)
                start = time.monotonic()
                answers = {k: f.result(timeout=30) for k, f in futures.items()}
                assert time.monotonic() - start < 15
            for name, (_, body) in answers.items():
                assert body["error"]["code"] == 503, (name, body)
                assert "worker 1" in body["error"]["message"], (name, body)
            assert httpx.get(server.url + "/health").status_code == 503
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    for pid in pids:
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"worker pid {pid} is still running"
            time.sleep(0.1)
