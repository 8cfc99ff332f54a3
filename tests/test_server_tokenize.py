"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on a real server (a tiny model whose
tokenizer adds a BOS, as Llama's does): the ids are the ones the completions and chat
routes feed the engine, decoding gives the text back, tokenizing and decoding run on the
tokenizer thread, and bad input is a 400 naming the field."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from minivllm.chat import chat_prompt
from tests.helpers import MODEL_NAME, TINY_VOCAB, make_tiny_chat_checkpoint

# Its own template: this model's tokenizer adds a BOS itself (the shared `server` fixture of
# conftest.py serves this module's `model_path`).
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<s>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w7 w8"}]
BOS = 1
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
CONTINUE = "continue_final_message"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_chat_checkpoint(tmp_path_factory.mktemp("tokenize-llama"), CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert tokenizer("w5").input_ids == [BOS, 8]  # encoding adds a BOS
    return tokenizer


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http, route: str, body) -> httpx.Response:
    """``body`` as ASCII JSON (a lone surrogate escaped, as any client may send it)."""
    headers = {"content-type": "application/json"}
    return http.post(route, content=json.dumps(body), headers=headers)


def tokenize(http, **body) -> dict:
    reply = post(http, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def detokenize(http, tokens: list[int]) -> str:
    reply = post(http, "/detokenize", {"model": MODEL_NAME, "tokens": tokens})
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt"]


def test_the_ids_are_the_ones_the_completions_route_feeds_the_engine(http, server, tokenizer):
    for prompt in ["w1 w2 w3", "w10 w20 w30 w40 w50 w60 w70", "w200"]:
        reply = tokenize(http, model=MODEL_NAME, prompt=prompt)
        assert reply["tokens"] == tokenizer(prompt).input_ids  # the BOS included
        assert reply["tokens"][0] == BOS and reply["count"] == len(reply["tokens"])
        assert reply["max_model_len"] == server.async_llm.engine.max_model_len == 512
        assert reply["token_strs"] is None
        completion = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert completion.json()["usage"]["prompt_tokens"] == reply["count"]
        bare = tokenize(http, prompt=prompt, add_special_tokens=False)
        assert bare["tokens"] == reply["tokens"][1:]


def test_the_chat_form_gives_the_chat_templates_ids(http, tokenizer):
    user_turn = MESSAGES[:1]
    reply = tokenize(http, messages=user_turn)
    expected = chat_prompt(tokenizer, user_turn)["prompt_token_ids"]
    assert reply["tokens"] == expected == [BOS, 4, 5, BOS]  # "<s> w1 w2 <s>"
    chat = post(http, "/v1/chat/completions", {"messages": user_turn, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == reply["count"] == 4
    # The switches, as vLLM has them: no assistant header; a BOS from the tokenizer too;
    # the final message left open.
    assert tokenize(http, messages=user_turn, add_generation_prompt=False)["tokens"] == [1, 4, 5]
    assert tokenize(http, messages=user_turn, add_special_tokens=True)["tokens"] == [
        BOS, BOS, 4, 5, BOS
    ]  # fmt: skip
    continued = tokenize(
        http, messages=MESSAGES, add_generation_prompt=False, continue_final_message=True
    )
    assert continued["tokens"] == [BOS, 4, 5, BOS, 10, 11]  # no " " after "w8" to close it
    text_parts = [{"type": "text", "text": "w1 "}, {"type": "text", "text": "w2"}]
    parts = [{"role": "user", "content": text_parts}]
    assert tokenize(http, messages=parts)["tokens"] == expected


def test_token_strs_and_a_prompt_longer_than_the_context_is_counted(http, tokenizer):
    reply = tokenize(http, prompt="w1 w2 w250", return_token_strs=True)
    assert reply["token_strs"] == ["<s>", "w1", "w2", "w250"]
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"])
    chat = tokenize(http, messages=MESSAGES[:1], return_token_strs=True)
    assert chat["token_strs"] == ["<s>", "w1", "w2", "<s>"]
    long = tokenize(http, prompt=" ".join(["w3"] * 600))
    assert long["count"] == 601 > long["max_model_len"]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(st.integers(0, len(TINY_VOCAB) - 1), max_size=20))
def test_detokenize_then_tokenize_round_trips(http, tokenizer, ids):
    text = detokenize(http, ids)
    assert text == tokenizer.decode(ids)  # special tokens kept, as in vLLM
    words = [i for i in ids if i > 2]  # no <unk>, <s>, </s>: each word is its own token
    if words:
        text = detokenize(http, words)
        assert tokenize(http, prompt=text, add_special_tokens=False)["tokens"] == words
        assert tokenize(http, prompt=text)["tokens"] == [BOS] + words


def test_tokenizing_and_decoding_run_on_the_tokenizer_thread(http, server, monkeypatch):
    tokenizer = server.async_llm.tokenizer
    threads = []

    def recorded(function):
        def call(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(tokenizer, "decode", recorded(tokenizer.decode))
    monkeypatch.setattr(
        tokenizer, "convert_ids_to_tokens", recorded(tokenizer.convert_ids_to_tokens)
    )
    detokenize(http, [4, 5])
    tokenize(http, prompt="w1", return_token_strs=True)
    tokenize(http, messages=MESSAGES[:1], return_token_strs=True)
    assert len(threads) == 3
    assert all(name.startswith("minivllm-tokenizer") for name in threads), threads


def assert_refused(reply: httpx.Response, param: str, status: int = 400) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/tokenize", {"prompt": "w1", "echo": True}, "echo"),  # unknown fields
        ("/tokenize", {"prompt": "w1", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "bad_words": ["w1"]}, "bad_words"),
        ("/detokenize", {"tokens": [4], "skip_special_tokens": True}, "skip_special_tokens"),
        ("/tokenize", {"prompt": "w1 \ud800"}, "prompt"),  # not encodable as UTF-8
        ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
        ("/tokenize", {"prompt": "w1", "model": "\ud800"}, "model"),
        ("/tokenize", {"prompt": ["w1"]}, "prompt"),  # wrong types
        ("/tokenize", {"prompt": "w1", "return_token_strs": "maybe"}, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages"),
        ("/detokenize", {"tokens": "w1"}, "tokens"),
        ("/detokenize", {"tokens": [4, "w1"]}, "tokens"),
        ("/detokenize", {}, "tokens"),  # missing
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "w1", "messages": MESSAGES}, "prompt"),  # both forms
        ("/tokenize", ["w1"], "body"),
        ("/tokenize", {"messages": MESSAGES, CONTINUE: True}, CONTINUE),  # and a header
        ("/tokenize", {"prompt": "w1 " * 1000}, "prompt"),  # cannot fit: not tokenized
        ("/detokenize", {"tokens": [4, len(TINY_VOCAB)]}, "tokens"),  # outside the vocabulary
        ("/detokenize", {"tokens": [-1, 4]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, route, body, param):
    assert_refused(post(http, route, body), param)


def test_an_unknown_model_is_a_404(http):
    assert_refused(post(http, "/tokenize", {"model": "gpt-4", "prompt": "w1"}), "model", 404)
    assert_refused(post(http, "/detokenize", {"model": "gpt-4", "tokens": [4]}), "model", 404)


def test_the_vocabulary_limit_is_named_in_the_message(http):
    reply = post(http, "/detokenize", {"tokens": [4, 256, -1]})
    assert "[256, -1]" in reply.json()["error"]["message"]
    assert "[0, 256)" in reply.json()["error"]["message"]
