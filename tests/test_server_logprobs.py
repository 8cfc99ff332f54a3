"""Logprobs over HTTP, with the official openai client against a real server: the
completions route's ``{tokens, token_logprobs, top_logprobs, text_offset}`` (also with
``echo``, as lm-eval scores a text: ``max_tokens`` 0 or 1), chat's ``content`` list,
streamed and not, and vLLM's ``prompt_logprobs`` field (chat's: the templated prompt's,
top-level); all equal what `LLM.generate` returns for the same request. Out-of-range
counts (-1, vLLM's "whole vocabulary", too) are a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from minivllm import SamplingParams
from tests.helpers import MODEL_NAME

openai = pytest.importorskip("openai")

PROMPT = "w1 w2 w3 w4 w5"


def offline(llm, **params):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, **params), use_tqdm=False)
    return out


def legacy(rows, token_ids):
    """What the completions route must send for these engine rows."""
    tokens = [row[t].decoded_token for t, row in zip(token_ids, rows)]
    return {
        "tokens": tokens,
        "token_logprobs": [
            pytest.approx(row[t].logprob, abs=1e-4) for t, row in zip(token_ids, rows)
        ],
        "top_logprobs": [
            {p.decoded_token: pytest.approx(p.logprob, abs=1e-4) for p in row.values()}
            for row in rows
        ],
    }


def as_dict(logprobs) -> dict:
    return {k: getattr(logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs")}


def test_completion_logprobs_equal_the_engine_s(client, llm):
    expected = offline(llm, max_tokens=5, logprobs=3).outputs[0]
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == expected.text
    assert as_dict(logprobs) == legacy(expected.logprobs, expected.token_ids)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)  # greedy: chosen is top-1
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_with_its_logprobs(client, llm, max_tokens):
    out = offline(llm, max_tokens=1, logprobs=2, prompt_logprobs=2)
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
        logprobs=2,
    )  # fmt: skip
    choice, prompt_ids = reply.choices[0], out.prompt_token_ids
    logprobs = choice.logprobs
    rows, token_ids = out.prompt_logprobs[1:], prompt_ids[1:]
    if max_tokens:
        rows, token_ids = rows + out.outputs[0].logprobs, token_ids + out.outputs[0].token_ids
    assert choice.text == PROMPT + (out.outputs[0].text if max_tokens else "")
    assert logprobs.tokens[0] == "w1"
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = legacy(rows, token_ids)
    assert {k: v[1:] for k, v in as_dict(logprobs).items()} == expected
    assert reply.usage.completion_tokens == max_tokens


def test_streamed_echo_of_the_prompt_alone_counts_no_completion_tokens(client):
    """``echo`` with ``max_tokens: 0`` generates one token to drop it: usage says 0, as the
    plain reply does."""
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, temperature=0, echo=True,
                logprobs=1)  # fmt: skip
    plain = client.completions.create(**body)
    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == PROMPT == plain.choices[0].text
    assert [c.usage for c in chunks if c.usage] == [plain.usage]
    assert plain.usage.completion_tokens == 0
    assert plain.usage.prompt_tokens == len(plain.choices[0].logprobs.tokens) > 1


def prompt_rows(rows) -> list:
    """The engine's prompt logprobs as the completions route sends them (vLLM's shape)."""

    def entry(p):
        logprob = pytest.approx(p.logprob, abs=1e-4)
        return {"logprob": logprob, "rank": p.rank, "decoded_token": p.decoded_token}

    return [None] + [{str(token_id): entry(p) for token_id, p in row.items()} for row in rows[1:]]


@pytest.mark.parametrize("echo", [False, True])
def test_prompt_logprobs_equal_the_engine_s(client, llm, echo):
    """vLLM's extra field: each prompt token's logprob and the top ones, by token id."""
    out = offline(llm, max_tokens=2, prompt_logprobs=3)
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=echo,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.prompt_logprobs == prompt_rows(out.prompt_logprobs)
    assert len(choice.prompt_logprobs) == len(out.prompt_token_ids) > 1
    for row, token_id in zip(choice.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert str(token_id) in row and {e["rank"] for e in row.values()} >= {1, 2, 3}
    assert choice.text == (PROMPT if echo else "") + out.outputs[0].text
    assert choice.logprobs is None  # `logprobs` not asked for
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].prompt_logprobs is None


def test_streamed_completion_logprobs_equal_the_whole_reply(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                echo=True)  # fmt: skip
    whole = client.completions.create(**body).choices[0]
    tokens, token_logprobs, top_logprobs, offsets, text = [], [], [], [], ""
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens
            token_logprobs += choice.logprobs.token_logprobs
            top_logprobs += choice.logprobs.top_logprobs
            offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert token_logprobs == [None] + [
        pytest.approx(p, abs=1e-4) for p in whole.logprobs.token_logprobs[1:]
    ]
    assert top_logprobs[1:] == [
        {t: pytest.approx(p, abs=1e-4) for t, p in top.items()}
        for top in whole.logprobs.top_logprobs[1:]
    ]
    assert offsets == whole.logprobs.text_offset


def test_chat_logprobs_and_top_logprobs(client, llm):
    messages = [{"role": "user", "content": PROMPT}]
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                     use_tqdm=False)  # fmt: skip
    expected = out.outputs[0]
    body = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                logprobs=True, top_logprobs=2)  # fmt: skip
    reply = client.chat.completions.create(**body)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [
        row[t].decoded_token for t, row in zip(expected.token_ids, expected.logprobs)
    ]
    for entry, token, row in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(row[token].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        ranked = sorted(row.values(), key=lambda p: p.rank)[:2]
        assert [t.token for t in entry.top_logprobs] == [p.decoded_token for p in ranked]
        assert [t.logprob for t in entry.top_logprobs] == [
            pytest.approx(p.logprob, abs=1e-4) for p in ranked
        ]
    streamed = [
        entry
        for chunk in client.chat.completions.create(**body, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    # (equal to float noise: the batch a request runs in changes the sums' order)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == [pytest.approx(e.logprob, abs=1e-4) for e in content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]
    plain = client.chat.completions.create(**(body | {"logprobs": False, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None


def test_chat_prompt_logprobs_are_the_completions_ones_for_the_templated_prompt(
    client, server, llm
):
    """vLLM's extra field on chat: the templated prompt's rows, top-level in the response
    (one list for all the choices), exactly what completions sends for the same ids."""
    k, messages = 3, [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": k},
    )  # fmt: skip
    templated = httpx.post(
        server.url + "/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30
    ).json()["tokens"]
    rows = reply.prompt_logprobs
    assert len(rows) == len(templated) == reply.usage.prompt_tokens > len(PROMPT.split())
    assert rows[0] is None
    for row, token_id in zip(rows[1:], templated[1:]):
        actual = row[str(token_id)]  # the prompt's own token, whatever its rank
        assert set(actual) == {"logprob", "rank", "decoded_token"}
        assert actual["logprob"] <= 0 and actual["rank"] >= 1
        assert len(row) <= k + 1 and {e["rank"] for e in row.values()} >= set(range(1, k + 1))
    assert all("prompt_logprobs" not in c.model_extra for c in reply.choices)
    completion = client.completions.create(
        model=MODEL_NAME, prompt=templated, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": k},
    )  # fmt: skip
    assert rows == completion.choices[0].prompt_logprobs  # exact: same ids, logprobs, ranks
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
                     use_tqdm=False)  # fmt: skip
    assert out.prompt_token_ids == templated and rows == prompt_rows(out.prompt_logprobs)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"prompt_logprobs": 1, "use_beam_search": True},
            "prompt_logprobs",
        ),
    ],
)
def test_out_of_range_logprobs_get_a_400_naming_the_field(server, route, fields, param):
    body = {"model": MODEL_NAME, "max_tokens": 2} | fields
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    reply = httpx.post(server.url + route, json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]
    if -1 in fields.values():  # vLLM's "the whole vocabulary": refused, saying so
        assert "vocabulary" in error["message"]
