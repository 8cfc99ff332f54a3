"""Nothing accepted and ignored, nothing a 5xx: every field of OpenAI's completions and
chat request schemas (read from the installed ``openai`` client, so the list follows it)
is either honoured or refused with a 400 naming it, and every JSON type in every field
(of vLLM's /tokenize and /detokenize too) gets an answer below 500. Plus the inputs a
tokenizer cannot take (lone surrogates), content parts of the wrong type, stop-string
limits, and penalties over HTTP equal to `LLM.generate`."""

from __future__ import annotations

import concurrent.futures
import json
import typing
from dataclasses import dataclass
from http.client import HTTPConnection, RemoteDisconnected
from urllib.parse import urlsplit

import pytest

from minivllm import SamplingParams
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from minivllm.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.helpers import MODEL_NAME

openai = pytest.importorskip("openai")

COMPLETION = {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2}
ROUTES = {"/v1/completions": (COMPLETION, CompletionRequest),
          "/v1/chat/completions": (CHAT, ChatCompletionRequest)}  # fmt: skip
# vLLM's tokenizer routes have no OpenAI schema: only their own fields are fuzzed. The
# chat form of /tokenize is the same route, named apart after a "#".
TOKENIZER_ROUTES = {
    "/tokenize": ({"model": MODEL_NAME, "prompt": "w1 w2"}, TokenizeCompletionRequest),
    "/tokenize#chat": ({"model": MODEL_NAME, "messages": CHAT["messages"]}, TokenizeChatRequest),
    "/detokenize": ({"model": MODEL_NAME, "tokens": [4, 5]}, DetokenizeRequest),
}


def openai_fields(params_type) -> set[str]:
    """The request fields of one of the client's ``CompletionCreateParams`` unions."""
    fields = set()
    for variant in typing.get_args(params_type):  # the streaming and non-streaming forms
        fields |= set(variant.__required_keys__) | set(variant.__optional_keys__)
    return fields


OPENAI_FIELDS = {
    "/v1/completions": openai_fields(openai.types.CompletionCreateParams),
    "/v1/chat/completions": openai_fields(openai.types.chat.CompletionCreateParams),
}

# Declared fields that are refused unless they ask for nothing: a value that asks for
# something, per route. Every other declared field is implemented (its effect is tested
# in test_sampling.py, test_penalties.py, test_stop_strings.py, test_server.py,
# test_server_logprobs.py) or, for
# ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier`` and the
# prompt-cache hints, cannot change the tokens.
REFUSED_VALUES = {
    "/v1/completions": {"suffix": "w9", "best_of": 2},
    "/v1/chat/completions": {},
}
NO_EFFECT = {"user", "metadata", "store", "service_tier", "safety_identifier",
             "prompt_cache_key", "prompt_cache_retention"}  # fmt: skip


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


class Client:
    """POSTs JSON over one keep-alive connection, headers and body in one write (httpx
    writes them apart, and Nagle's algorithm then waits for a delayed ACK: 40 ms per
    request, which made this file's fuzz slow). The JSON is ASCII (``\\ud800``
    escaped), as any client may legally send it."""

    def __init__(self, url: str) -> None:
        address = urlsplit(url)
        self.connection = HTTPConnection(address.hostname, address.port, timeout=60)

    def post(self, route: str, body: dict) -> Reply:
        headers = {"content-type": "application/json"}
        content = json.dumps(body).encode()
        try:
            self.connection.request("POST", route, body=content, headers=headers)
            reply = self.connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, RemoteDisconnected):
            # The server closed the idle connection (uvicorn's keep-alive timeout): reopen.
            self.connection.close()
            self.connection.request("POST", route, body=content, headers=headers)
            reply = self.connection.getresponse()
        return Reply(reply.status, reply.read().decode())


@pytest.fixture(scope="module")
def http(server):
    client = Client(server.url)
    yield client
    client.connection.close()


def assert_refused(reply: Reply, param: str, named: bool = False) -> None:
    """A 400 with OpenAI's error JSON blaming ``param`` (``named``: in its message too)."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and (param in error["message"] or not named), error
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize("route", ROUTES)
def test_every_openai_field_is_honoured_or_refused(http, route):
    base, model = ROUTES[route]
    declared = set(model.model_fields)
    assert OPENAI_FIELDS[route] >= {"model", "temperature", "logit_bias"}  # the walk works
    for field in sorted(OPENAI_FIELDS[route]):
        if field not in declared:  # not implemented: refused, whatever the value
            for value in ["auto", {"type": "text"}, [], True]:
                assert_refused(http.post(route, base | {field: value}), field, named=True)
        elif field in REFUSED_VALUES[route]:
            reply = http.post(route, base | {field: REFUSED_VALUES[route][field]})
            assert_refused(reply, field, named=True)
    for field in REFUSED_VALUES[route]:
        assert field in declared
        del_value = {"best_of": 1, "echo": False, "logprobs": None, "suffix": None,
                     "top_logprobs": None}[field]  # fmt: skip
        if route.endswith("chat/completions") and field == "logprobs":
            del_value = False
        assert http.post(route, base | {field: del_value}).status_code == 200
    for field in NO_EFFECT & declared:
        value = {"metadata": {"k": "v"}, "store": False}.get(field, "x")
        assert http.post(route, base | {field: value}).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_vllm_fields_it_does_not_implement_are_refused(http, route):
    base, _ = ROUTES[route]
    refused = [("guided_json", {}), ("bad_words", ["w1"]), ("truncate_prompt_tokens", 3)]
    for field, value in refused:
        assert_refused(http.post(route, base | {field: value}), field, named=True)
    reply = http.post(route, base | {"stream_options": {"continuous_usage_stats": True}})
    assert_refused(reply, "stream_options")


JSON_VALUES = [None, True, 0, -1, 2.5, 1e300, 10**30, "", "w1", "\ud800", [], [0], ["w1"],
               [[1]], {}, {"1": 1}, {"type": "text"}]  # fmt: skip


@pytest.mark.slow  # some 1,700 requests: ~6 s a route
@pytest.mark.parametrize("route", list(ROUTES) + list(TOKENIZER_ROUTES))
def test_no_json_value_in_any_field_is_a_5xx(server, route):
    """The schema fuzz: every JSON type into every field (OpenAI's and minivllm's), and
    into the fields of a message and of a content part."""
    base, model = (ROUTES | TOKENIZER_ROUTES)[route]
    bodies = [
        (field, base | {field: value})
        for field in sorted(OPENAI_FIELDS.get(route, set()) | set(model.model_fields))
        for value in JSON_VALUES
    ]
    if "messages" in base:
        for key in ["role", "content", "name", "tool_calls"]:
            for value in JSON_VALUES:
                message = {"role": "user", "content": "w1"} | {key: value}
                bodies.append(("messages", base | {"messages": [message]}))
                part = {"type": "text", "text": "w1"} | {key: value}
                bodies.append(
                    ("messages", base | {"messages": [{"role": "user", "content": [part]}]})
                )

    # Eight connections at once: a request mostly waits on the loopback, not on the CPU.
    clients = [Client(server.url) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        batches = [bodies[i :: len(clients)] for i in range(len(clients))]
        path = route.split("#")[0]
        sent = pool.map(lambda c, batch: [(f, b, c.post(path, b)) for f, b in batch],
                        clients, batches)  # fmt: skip
        replies = [reply for batch in sent for reply in batch]
    failures = [
        (body, r.status_code, r.text[:200]) for _, body, r in replies if r.status_code >= 500
    ]
    assert not failures, failures
    accepted_unknown = [
        f for f, _, r in replies if r.status_code == 200 and f not in model.model_fields
    ]
    assert not accepted_unknown
    assert {r.status_code for _, _, r in replies} >= {200, 400}  # both kinds were reached


@pytest.mark.parametrize(
    "part",
    [{"type": "text", "text": 3}, {"type": "text", "text": None}, {"type": "text"},
     {"type": "image_url", "image_url": {"url": "http://x"}}, "w1", 5,
     {"type": "text", "text": "w1", "extra": 1}],
)  # fmt: skip
def test_wrong_content_parts_are_400(http, part):
    body = CHAT | {"messages": [{"role": "user", "content": [part]}]}
    assert_refused(http.post("/v1/chat/completions", body), "messages")
    good = CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]}
    assert http.post("/v1/chat/completions", good).status_code == 200


@pytest.mark.parametrize(
    "route, change, param",
    [
        ("/v1/completions", {"prompt": "w1 \ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["\udfff"]}, "prompt"),
        ("/v1/completions", {"stop": ["\ud800"]}, "stop"),
        ("/v1/completions", {"model": "\ud800"}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
         "messages"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400(http, route, change, param):
    assert_refused(http.post(route, ROUTES[route][0] | change), param)


def test_stop_string_limits(http):
    too_many = [f"w{i} w{i + 1}" for i in range(MAX_STOP_STRINGS + 1)]
    assert_refused(http.post("/v1/completions", COMPLETION | {"stop": too_many}), "stop")
    too_long = ["w1" * MAX_STOP_STRING_CHARS]
    assert_refused(http.post("/v1/completions", COMPLETION | {"stop": too_long}), "stop")
    at_limit = too_many[:MAX_STOP_STRINGS]
    assert http.post("/v1/completions", COMPLETION | {"stop": at_limit}).status_code == 200


def test_text_longer_than_any_tokenization_could_fit_is_refused_untokenized(http, server):
    limit = server.async_llm.max_model_len * server.async_llm.max_chars_per_token
    reply = http.post("/v1/completions", COMPLETION | {"prompt": "w" * (limit + 1)})
    assert_refused(reply, "prompt")
    assert "characters" in reply.json()["error"]["message"]
    body = CHAT | {"messages": [{"role": "user", "content": "w" * (limit + 1)}]}
    assert_refused(http.post("/v1/chat/completions", body), "messages")


def test_tiny_top_p_is_greedy_not_an_empty_answer(http):
    """top_p=1e-300 is 0.0 in float32: the most likely token still stays."""
    body = COMPLETION | {"max_tokens": 6, "ignore_eos": True}
    greedy = http.post("/v1/completions", body | {"temperature": 0}).json()
    tiny = http.post("/v1/completions", body | {"temperature": 1, "top_p": 1e-300}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"] != ""


@pytest.mark.parametrize(
    "change",
    [{"repetition_penalty": 1.7}, {"frequency_penalty": 2, "presence_penalty": 2},
     {"frequency_penalty": -2, "presence_penalty": -2},
     {"logit_bias": {"7": 20, "9": -100}}, {"allowed_token_ids": [5, 7, 9]}],
)  # fmt: skip
def test_penalties_over_http_equal_llm_generate(http, llm, change):
    prompt = "w72 w17 w40 w72 w17"  # the tiny model's greedy text here repeats some words
    body = COMPLETION | {"prompt": prompt, "max_tokens": 40, "ignore_eos": True} | change
    body["temperature"] = 0
    reply = http.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text
    options = dict(change)
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **options)
    [expected] = llm.generate(prompt, params, use_tqdm=False)
    assert reply.json()["choices"][0]["text"] == expected.outputs[0].text
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [unchanged] = llm.generate(prompt, plain, use_tqdm=False)
    assert unchanged.outputs[0].text != expected.outputs[0].text


def test_bad_penalty_values_over_http_are_400(http):
    for change, param in [({"frequency_penalty": 3}, "frequency_penalty"),
                          ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"logit_bias": {"7": 101}}, "logit_bias"),
                          ({"logit_bias": {"999999": 1}}, "logit_bias"),
                          ({"logit_bias": {"w1": 1}}, "logit_bias"),
                          ({"allowed_token_ids": [100000]}, "allowed_token_ids")]:  # fmt: skip
        assert_refused(http.post("/v1/completions", COMPLETION | change), param)
