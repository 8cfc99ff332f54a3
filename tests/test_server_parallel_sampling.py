"""``n > 1`` over HTTP: a real `minivllm serve` on 127.0.0.1 (tiny random model), driven by
the openai client. Choices carry their ``index`` in plain responses and in streams, and
``usage`` counts the prompt once and every choice's tokens."""

from __future__ import annotations

from collections import defaultdict

import pytest

from minivllm import SamplingParams
from tests.helpers import ENGINE_OPTIONS, MODEL_NAME

openai = pytest.importorskip("openai")

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8 w9"  # 9 tokens: two full blocks of 4 shared


def offline(llm, **params) -> list[str]:
    [output] = llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)
    return [c.text for c in output.outputs]


def test_completions_n_plain_equals_offline_with_usage_for_every_choice(client, llm):
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=3, temperature=1.0, seed=11, max_tokens=5
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    expected = offline(llm, n=3, temperature=1.0, seed=11, max_tokens=5)
    assert [c.text for c in reply.choices] == expected
    assert len(set(expected)) > 1  # three different samples
    assert reply.usage.prompt_tokens == 9  # once, not three times
    assert reply.usage.completion_tokens == 3 * 5
    assert reply.usage.total_tokens == 9 + 15


def test_completions_n_stream_gathers_by_index(client, llm):
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=2, temperature=1.0, seed=5, max_tokens=6,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finish = defaultdict(str), {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(2)] == offline(llm, n=2, temperature=1.0, seed=5, max_tokens=6)
    assert finish == {0: "length", 1: "length"}
    assert usage.prompt_tokens == 9 and usage.completion_tokens == 2 * 6


def test_chat_n_plain_and_streamed(client, llm):
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, n=3, temperature=0, max_tokens=4
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    [expected] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert all(c.message.content == expected.outputs[0].text for c in reply.choices)
    assert reply.usage.completion_tokens == 3 * 4

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, n=2, temperature=0, max_tokens=4, stream=True
    )
    roles, texts = set(), defaultdict(str)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1}  # each choice opens with its role
    assert dict(texts) == {0: expected.outputs[0].text, 1: expected.outputs[0].text}


def test_best_of_stays_refused(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, best_of=3, max_tokens=2)


@pytest.mark.parametrize("stream", [False, True])
def test_n_over_max_num_seqs_is_400(client, stream):
    n = ENGINE_OPTIONS["max_num_seqs"] + 1
    with pytest.raises(openai.BadRequestError, match=f"n={n} is more than max_num_seqs"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=n, max_tokens=2,
                                  stream=stream)  # fmt: skip


def test_a_client_leaving_an_n_stream_aborts_every_choice(server):
    import httpx

    from tests.test_server import _metric, _wait_until_idle

    def generated() -> float:
        return _metric(httpx.get(server.url + "/metrics").text, "vllm:generation_tokens_total")

    before = generated()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": 3, "max_tokens": 500,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        assert next(reply.iter_lines()).startswith("data: ")
    stats = _wait_until_idle(server, timeout=10)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert not server.async_llm.engine.request_groups["parallel_sampling"].parents
    assert generated() - before < 3 * 500  # no choice ran to its end
