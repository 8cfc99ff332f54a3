"""Graceful shutdown of a real `minivllm serve` process: SIGTERM with streams in flight.
The port stops taking connections, each client hears how its request ended (its full
answer, or an error event and ``[DONE]``), the process exits within the grace period,
and nothing prints a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import free_port, wait_until_healthy

GRACE_PERIOD = 1.0  # --shutdown-timeout
NUM_STREAMS = 16


def _start_server(model_path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "minivllm.cli", "serve", "--model", str(model_path)]
    command += ["--port", str(port), "--attention-backend", "torch", "--num-kv-blocks", "256"]
    command += ["--block-size", "16", "--shutdown-timeout", str(GRACE_PERIOD)]
    command += ["--log-level", "warning"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until_healthy(f"http://127.0.0.1:{port}", process, timeout_s=90)
    return process


def _stream(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    """One streamed completion; its SSE payloads go to ``events`` (or the exception)."""
    body = {"prompt": "w1 w2", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    started.set()
    except Exception as e:  # the test asserts there is none
        events.append(e)
        started.set()


@pytest.mark.slow  # a fresh process imports torch and loads the model: ~15-30 s
def test_sigterm_with_streams_in_flight(tiny_llama_path):
    port = free_port()
    process = _start_server(tiny_llama_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        # Half short (they finish within the grace period), half far too long to.
        lengths = [4 if i % 2 else 480 for i in range(NUM_STREAMS)]
        results = [[] for _ in lengths]
        started = [threading.Event() for _ in lengths]
        threads = [
            threading.Thread(target=_stream, args=(url, n, events, s), daemon=True)
            for n, events, s in zip(lengths, results, started)
        ]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30), "a stream never started"

        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the port no longer takes connections
            httpx.post(url + "/v1/completions", json={"prompt": "w1"}, timeout=5)
        assert process.wait(timeout=GRACE_PERIOD + 15) == 0
        exit_time = time.monotonic() - signalled
        for thread in threads:
            thread.join(10)
        output = process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()

    assert "Traceback" not in output and "timeout graceful shutdown" not in output, output
    assert exit_time < GRACE_PERIOD + 10
    num_aborted = 0
    for n, events in zip(lengths, results):
        assert not any(isinstance(e, Exception) for e in events), events
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:  # aborted at the deadline: told so in-band
            assert last["error"]["code"] == 503 and "shut down" in last["error"]["message"]
            assert n == 480  # a short stream finishes well within the grace period
            num_aborted += 1
        else:  # finished within the grace period: the whole answer, then usage
            assert last["usage"]["completion_tokens"] == n
            assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert num_aborted >= 1  # long ones did not fit in the grace period
