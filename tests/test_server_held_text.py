"""A streamed delta that carries tokens but no text yet (the text is held back while it
may still turn into a stop string) delivers those tokens' logprobs at once, one entry per
token, and the stream's entries add up to the plain reply's. Real server, tiny model."""

from __future__ import annotations

import json

import httpx

from tests.helpers import MODEL_NAME


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=30) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_held_back_text_still_streams_its_tokens_logprobs(server):
    url = server.url + "/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}  # fmt: skip
    plain = httpx.post(url, json=body, timeout=30).json()["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    assert len(tokens) == 8
    # A stop string the first three tokens' text begins, then breaks off: while they come,
    # their text is held back, and is let go with the fourth.
    held = "".join(tokens[:3])
    stop = held + "\u2603"
    assert stop not in plain["text"]
    chunks = _stream(url, body | {"stop": [stop]})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    silent = [c for c in choices if c["text"] == "" and c["logprobs"]["tokens"]]
    assert len(silent) >= 2, choices  # deltas with tokens and no text
    for choice in choices:
        logprobs = choice["logprobs"]
        n = len(logprobs["tokens"])
        assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n
        assert len(logprobs["text_offset"]) == n
    streamed = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert streamed == tokens
    lps = [p for c in choices for p in c["logprobs"]["token_logprobs"]]
    assert lps == plain["logprobs"]["token_logprobs"]
    assert "".join(c["text"] for c in choices) == plain["text"]
