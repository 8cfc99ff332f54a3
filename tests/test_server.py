"""`minivllm serve` for real: a server on 127.0.0.1 and a free port (a tiny random model
behind it), driven by the official openai client and raw HTTP. Greedy text equals
`LLM.generate` / `LLM.chat`; concurrent streams share engine steps; a client that leaves
is aborted and its blocks freed; bad input gets vLLM's status and error JSON; the live
page renders in headless Chromium. The real-model equality test is in
test_server_smollm2.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from minivllm import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from minivllm.entrypoints.async_llm import AsyncLLM
from tests.helpers import (
    ENGINE_OPTIONS,
    MODEL_NAME,
    free_port,
    wait_until_healthy,
)

openai = pytest.importorskip("openai")

PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40 w50 w60 w70", "w200"]


def _wait_until_idle(server, timeout: float = 20.0) -> dict:
    """The engine's stats once nothing is in flight (read while its thread sleeps)."""
    deadline = time.monotonic() + timeout
    engine = server.async_llm.engine
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests():
            time.sleep(0.05)  # let a queued abort or the last step land
            if not engine.has_unfinished_requests():
                return engine.stats()
        time.sleep(0.02)
    raise AssertionError("requests still in flight")


def _metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


# --- AsyncLLM on its own ------------------------------------------------------------------


def test_async_llm_streams_deltas_and_survives_bad_input(model_path, llm):
    engine = LLMEngine(EngineConfig(model=str(model_path), **ENGINE_OPTIONS))
    async_llm = AsyncLLM(engine)
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def run():
        with pytest.raises(ValueError, match="prompt is empty"):
            await async_llm.add_request("bad", "", params)

        async def collect(request_id, prompt):
            return [o async for o in async_llm.generate(request_id, prompt, params)]

        # Two requests at once, each with its own stream of deltas.
        return await asyncio.gather(*(collect(str(i), p) for i, p in enumerate(PROMPTS[:2])))

    try:
        streams = asyncio.run(run())
    finally:
        async_llm.shutdown()
    assert not async_llm.is_alive
    expected = llm.generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    for outputs, want in zip(streams, expected):
        assert [o.finished for o in outputs] == [False] * 7 + [True]  # one output per step
        assert "".join(o.outputs[0].text for o in outputs) == want.outputs[0].text
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == 8


# --- the openai client against LLM.generate / LLM.chat --------------------------------------


def test_completions_equal_llm_generate(client, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        reply = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == want.outputs[0].text
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        assert reply.usage.completion_tokens == 12
        assert reply.usage.total_tokens == len(want.prompt_token_ids) + 12

        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text_chunks = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in text_chunks) == want.outputs[0].text
        assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_equals_llm_chat(client, llm):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.chat(conversations, params, use_tqdm=False)
    for conversation, want in zip(conversations, expected):
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=conversation,
            max_completion_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        assert reply.usage.completion_tokens == 10

        chunks = list(
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=conversation,
                max_tokens=10,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage is None  # no stream_options: no usage chunk, as in OpenAI


def test_stop_seed_and_sampling_fields(client):
    args = dict(model=MODEL_NAME, prompt="w1 w2 w3", max_tokens=12, temperature=0)
    args["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**args).choices[0].text
    stop = full.split()[3]  # the fourth generated word
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and full.startswith(cut.text)
    assert cut.text == full[: full.index(stop)]
    assert cut.model_extra["stop_reason"] == stop

    sampled = dict(args, temperature=1.0, top_p=0.9, seed=7)
    sampled["extra_body"] = {"ignore_eos": True, "top_k": 50, "min_p": 0.01}
    first, again = (client.completions.create(**sampled).choices[0].text for _ in range(2))
    assert first == again  # a per-request seed makes sampling reproducible


def test_sse_wire_format(server):
    """The bytes a non-openai client sees: data: events, [DONE] last, one id and created."""
    body = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 4, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-") and chunks[0]["object"] == "text_completion"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_models_health_version(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == server.async_llm.max_model_len
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


# --- online batching ------------------------------------------------------------------------


def test_concurrent_streams_share_steps(server):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"w{i + 1} w{i + 2} w{i + 3}",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return chunks[0].id, chunks[-1].usage.completion_tokens

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    first_step = server.async_llm.num_steps
    results = asyncio.run(all_of_them())
    assert [n for _, n in results] == [16] * 16
    ids = {request_id for request_id, _ in results}
    steps = [r.stats for r in server.async_llm.recent_steps if r.index > first_step]
    together = max(len(ids & set(s.prefill_ids + s.decode_ids)) for s in steps)
    assert together >= 8, f"at most {together} of the 16 requests shared a step"
    assert _wait_until_idle(server)["num_free_blocks"] == ENGINE_OPTIONS["num_kv_blocks"]


def test_disconnected_clients_are_aborted(server):
    before = httpx.get(server.url + "/metrics").text
    aborted_before = _metric(before, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": "w7 w8", "max_tokens": 500, "temperature": 0}
    body["ignore_eos"] = True
    # Three streams read two events each, then hang up.
    for _ in range(3):
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=60
        ) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
    # A stream whose client hangs up on the headers, before reading any event.
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=60
    ) as reply:
        assert reply.status_code == 200
    # A plain request whose client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.2)

    stats = _wait_until_idle(server, timeout=10)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    after = httpx.get(server.url + "/metrics").text
    assert _metric(after, "vllm:num_requests_running") == 0
    assert _metric(after, "vllm:kv_cache_usage_perc") == 0
    aborted = _metric(after, "vllm:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 5
    # 5 x 500 tokens were not generated: they stopped when their clients left.
    assert (
        _metric(after, "vllm:generation_tokens_total")
        < _metric(before, "vllm:generation_tokens_total") + 5 * 200
    )


def test_idle_server_uses_no_cpu(server, client):
    client.completions.create(model=MODEL_NAME, prompt="w1", max_tokens=2)
    _wait_until_idle(server)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    used = (time.process_time() - cpu) / (time.monotonic() - wall)
    assert used < 0.05, f"idle server used {used:.0%} of a core"


def test_metrics_have_vllm_names_and_exact_counts(server, client):
    _wait_until_idle(server)
    before = httpx.get(server.url + "/metrics").text
    for stream in (False, True):  # a FINAL_ONLY and a DELTA request: counted alike
        reply = client.completions.create(
            model=MODEL_NAME,
            prompt="w3 w4 w5",
            max_tokens=5,
            temperature=0,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            list(reply)
    _wait_until_idle(server)
    text = httpx.get(server.url + "/metrics").text
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ]:
        assert f"\n{name}{{" in text, name

    def grew(name: str, **labels) -> float:
        return _metric(text, name, **labels) - _metric(before, name, **labels)

    assert grew("vllm:generation_tokens_total") == 2 * 5
    assert grew("vllm:prompt_tokens_total") == 2 * 3  # "w3 w4 w5": 3 tokens, no BOS
    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert _metric(text, "vllm:num_requests_running") == 0


# --- bad input ------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"n": 0}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "w1 " * 600}, "prompt"),  # longer than the 512-token context
    ({"max_tokens": 510}, "max_tokens"),  # prompt + max_tokens over the context
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": 3}, "stop"),
    ({"prompt": None}, "prompt"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_completion_is_400_naming_the_field(server, change, param, stream):
    body = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 4, "stream": stream}
    reply = httpx.post(server.url + "/v1/completions", json=body | change, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == 400
    assert error["type"] == "BadRequestError" and error["message"]
    good = httpx.post(server.url + "/v1/completions", json=body | {"stream": False}, timeout=30)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_bad_chat_and_malformed_json(server):
    url = server.url + "/v1/chat/completions"
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "w1"}]}, "messages"),  # no role
        ({"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 0}, None),
    ]:
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 400, reply.text
        if param:
            assert reply.json()["error"]["param"] == param
    reply = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == 400


def test_unknown_model_is_404(server):
    reply = httpx.post(
        server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "w1"}, timeout=30
    )
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": f"The model `gpt-9` does not exist. Served: `{MODEL_NAME}`.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


# --- the process: SIGTERM / SIGINT ------------------------------------------------------------


@pytest.mark.slow  # a fresh process imports torch and loads the model: ~15-30 s
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_process_shuts_down_cleanly(model_path, sig):
    port = free_port()
    command = [sys.executable, "-m", "minivllm.cli", "serve"]
    command += ["--model", str(model_path), "--port", str(port), "--attention-backend", "torch"]
    command += ["--num-kv-blocks", "64", "--log-level", "warning"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, process, timeout_s=60)
        body = {"prompt": "w1 w2", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        process.send_signal(sig)
        assert process.wait(timeout=30) == 0
        output = process.stdout.read().decode()
        assert "Traceback" not in output, output
    finally:
        if process.poll() is None:
            process.kill()


# --- the live page ----------------------------------------------------------------------------


def test_live_page_shows_the_requests(server, client, tmp_path):
    from tests.test_docs_site import CHROMIUM, _chromium

    if CHROMIUM is None:
        pytest.skip("headless Chromium not found (apt-get install -y chromium)")
    ids = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0).id
        for p in PROMPTS
    ]
    dom = _chromium(server.url + "/", tmp_path / "profile-dom", "--dump-dom").stdout
    for request_id in ids:
        # A row label in the step grid and a row in the request table.
        assert dom.count(f'data-request-id="{request_id}"') == 2, request_id
    assert 'class="cell decode"' in dom and 'class="cell prefill"' in dom

    screenshot = tmp_path / "live.png"
    _chromium(server.url + "/", tmp_path / "profile-shot", f"--screenshot={screenshot}")
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(screenshot).convert("RGB")).reshape(-1, 3)
    cell_area = 10 * 13  # a grid cell's pixels

    def count(colour: tuple[int, int, int]) -> int:
        return int((pixels == colour).all(axis=1).sum())

    assert count((0x4E, 0x79, 0xA7)) > 3 * 5 * cell_area  # decode: 3 requests x 5 steps
    assert count((0xF2, 0x8E, 0x2B)) > 3 * cell_area  # prefill
