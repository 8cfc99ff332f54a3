"""One huge request never stalls the others: while a stream runs, a 10 MB prompt, a 10 MB
chat message, a prompt just under the character pre-check and a request with 20,000
stop strings are each refused (400), and the stream's largest gap between two events
stays within a few steps' time. (Before: the 10 MB prompt was tokenized on the engine
thread, an 18 s gap on SmolLM2; the stop list was accepted and checked every step.)"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.entrypoints.openai.api_server import BackgroundServer
from tests.helpers import make_tiny_chat_checkpoint

ENGINE_OPTIONS = dict(num_kv_blocks=256, block_size=4, attention_backend="torch")
CHAT_TEMPLATE = "{% for message in messages %}<s> {{ message['content'] }} {% endfor %}<s>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("stall-llama"), CHAT_TEMPLATE)
    engine = LLMEngine(EngineConfig(model=str(path), **ENGINE_OPTIONS))
    with BackgroundServer(engine, model_name="tiny") as server:
        yield server


def _stream_event_times(url: str, times: list[float], started: threading.Event) -> None:
    body = {"prompt": "w1 w2", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line:
                times.append(time.perf_counter())
                if len(times) == 20:
                    started.set()


def test_huge_requests_do_not_stall_a_running_stream(server):
    limit = server.async_llm.max_model_len * server.async_llm.max_chars_per_token
    ten_mb = "w1 " * 3_500_000
    huge = [  # (route, body, param): encoded before the stream starts
        ("/v1/completions", {"prompt": ten_mb}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ten_mb}]}, "messages"),
        ("/v1/completions", {"prompt": ("w1 " * limit)[:limit]}, "prompt"),  # tokenized
        ("/v1/completions", {"prompt": "w1", "stop": [f"w{i}" for i in range(20_000)]}, "stop"),
    ]
    encoded = [(route, json.dumps(body).encode(), param) for route, body, param in huge]

    times: list[float] = []
    started = threading.Event()
    stream = threading.Thread(target=_stream_event_times, args=(server.url, times, started))
    stream.start()
    assert started.wait(60)
    window_start = time.perf_counter()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for route, content, param in encoded:
            reply = client.post(
                route, content=content, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 400, reply.text[:300]
            assert reply.json()["error"]["param"] == param
    window_end = time.perf_counter()
    stream.join(120)

    assert len(times) > 400  # an event per token with text (<s> and </s> have none)
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b >= window_start and a <= window_end]
    typical = statistics.median(gaps)
    print(f"median gap {typical * 1e3:.1f} ms, largest while refusing {max(during) * 1e3:.1f} ms")
    assert during, "the stream ended before the huge requests were sent"
    assert max(during) < 10 * typical + 0.2
