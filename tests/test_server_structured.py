"""`minivllm serve` with structured outputs and forced tool calls, through the openai
client: response_format (json_schema, json_object), vLLM's structured_outputs, tools with
tool_choice "required" or a named function (streamed too), and the 400s, each naming its
field. The served model is the byte-level tiny llama (structured_helpers.py)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minivllm import SamplingParams  # noqa: E402
from minivllm import StructuredOutputsParams as SO  # noqa: E402
from tests.helpers import MODEL_NAME  # noqa: E402
from tests.structured_helpers import make_byte_checkpoint  # noqa: E402

MESSAGES = [{"role": "user", "content": "Call a tool."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A fixed set of tool schemas: every forced call must parse and validate.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a", "b"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "description": "no arguments"}},
    {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "maxItems": 2,
        "items": {"type": "string", "maxLength": 3}}, "urgent": {"type": "boolean"}},
        "required": ["tags", "urgent"], "additionalProperties": False}}},
]  # fmt: skip
PARAMETERS = {
    t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_byte_checkpoint(tmp_path_factory.mktemp("served-bytes"))


def _chat(client, **fields):
    fields.setdefault("max_tokens", 200)
    fields.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **fields)


def test_response_format_json_schema_equals_offline(client, llm):
    response = _chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    offline = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=200, temperature=0, structured_outputs=SO(json=PERSON)),
        use_tqdm=False,
    )
    assert choice.message.content == offline[0].outputs[0].text


def test_json_object_and_structured_outputs_on_completions(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt="{", max_tokens=200, temperature=0, n=3, seed=1,
        extra_body={"response_format": {"type": "json_object"}},  # vLLM's, not OpenAI's
    )  # fmt: skip
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
    for extra, ok in [
        ({"choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"grammar": 'start: "x" ("+" "x")*'}, lambda t: re.fullmatch(r"x(\+x)*", t)),
        ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ]:
        text = client.completions.create(
            model=MODEL_NAME, prompt="go", max_tokens=100, temperature=0,
            extra_body={"structured_outputs": extra},
        ).choices[0].text  # fmt: skip
        assert ok(text), (extra, text)


def test_text_response_format_is_no_constraint(client):
    free = _chat(client, max_tokens=12)
    text = _chat(client, max_tokens=12, response_format={"type": "text"})
    assert free.choices[0].message.content == text.choices[0].message.content


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_tool_choice_required_always_parses(client, seed):
    """Every forced call of every sampled answer parses and validates, for each of the
    fixed tools' schemas."""
    response = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, n=3)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        _check_calls(choice.message.tool_calls)
    single = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=1.0, seed=seed)  # fmt: skip
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_named_tool_choice(client, name):
    choice = {"type": "function", "function": {"name": name}}
    response = _chat(client, tools=TOOLS, tool_choice=choice)
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == [name]
    _check_calls(calls)
    streamed = _stream_calls(client, tools=TOOLS, tool_choice=choice)
    assert streamed == [(name, calls[0].function.arguments)]


def test_required_streamed_equals_plain(client):
    plain = _chat(client, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls
    streamed = _stream_calls(client, tools=TOOLS, tool_choice="required")
    assert streamed == [(c.function.name, c.function.arguments) for c in plain]


def _stream_calls(client, **fields):
    """The tool calls of a stream, put together as a client does: by index, the name
    from the first delta, the arguments appended."""
    calls: dict[int, list] = {}
    for chunk in _chat(client, stream=True, **fields):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, [None, ""])
                if delta.function.name:
                    assert delta.id and call[0] is None
                    call[0] = delta.function.name
                call[1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def test_tool_choice_none_ignores_the_tools(client):
    response = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert response.choices[0].message.tool_calls in (None, [])
    assert (
        response.choices[0].message.content
        == _chat(client, max_tokens=8).choices[0].message.content
    )


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": TOOLS}, "tool_choice", '"auto"'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope'"),
        ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "distinct"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "foo"}}}}, "response_format", "does not compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 1}}},
         "structured_outputs", "Unsatisfiable"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "response_format", "send one"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "cannot constrain it too"),
        ({"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}},
         "response_format", "beam search"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
