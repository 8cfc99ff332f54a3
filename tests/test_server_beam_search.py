"""Beam search over HTTP (vLLM's ``use_beam_search`` extra field): a real `minivllm serve`
on 127.0.0.1 (tiny random model), driven by the openai client. ``n`` beams come back as
the choices, best first, equal to `LLM.beam_search`; fields only sampling reads are
refused with OpenAI's error JSON, before any work."""

from __future__ import annotations

import pytest

from minivllm import BeamSearchParams
from minivllm.chat import chat_prompt
from tests.helpers import MODEL_NAME

openai = pytest.importorskip("openai")

PROMPT = "w1 w2 w3 w4 w5 w6 w7"
BEAMS = {"use_beam_search": True}


def offline_beams(llm, prompt, width, max_tokens, **options) -> list[str]:
    [out] = llm.beam_search(prompt, BeamSearchParams(width, max_tokens, **options))
    return [seq.text for seq in out.sequences]


def test_completions_beams_equal_offline_best_first_with_usage(client, llm):
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=6, extra_body=BEAMS | {"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    expected = offline_beams(llm, PROMPT, 3, 6, ignore_eos=True)
    assert [c.text for c in reply.choices] == expected
    assert len(set(expected)) == 3  # three different beams
    assert {c.finish_reason for c in reply.choices} == {"length"}
    assert reply.usage.prompt_tokens == len(llm.get_tokenizer()(PROMPT).input_ids)
    assert reply.usage.completion_tokens == 3 * 6


def test_length_penalty_reaches_the_search(client, llm):
    for penalty in (0.0, 2.0):
        reply = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=5,
            extra_body=BEAMS | {"length_penalty": penalty},
        )  # fmt: skip
        expected = offline_beams(llm, PROMPT, 2, 5, length_penalty=penalty)
        assert [c.text for c in reply.choices] == expected


def test_streamed_beams_come_in_one_event_per_choice_set(client, llm):
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body=BEAMS | {"ignore_eos": True},
    )  # fmt: skip
    texts, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(2)] == offline_beams(llm, PROMPT, 2, 4, ignore_eos=True)
    assert usage.completion_tokens == 2 * 4


def test_chat_beams_equal_offline(client, llm):
    messages = [{"role": "user", "content": "w3 w4"}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, n=2, max_completion_tokens=5, extra_body=BEAMS
    )
    prompt = chat_prompt(llm.get_tokenizer(), messages)
    assert [c.message.content for c in reply.choices] == offline_beams(llm, prompt, 2, 5)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 11}, "n"),
        ({"n": 0}, "n"),
        ({"top_p": 0.5}, "top_p"),
        ({"seed": 3}, "seed"),
        ({"stop": ["w9"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_what_beam_search_does_not_read_is_refused(server, fields, param):
    import httpx

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, **BEAMS, **fields}
    reply = httpx.post(server.url + "/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error


def test_a_length_penalty_that_would_overflow_is_a_400_and_others_still_run(client, llm):
    """length_penalty 1000 raised OverflowError inside the step, failing every request
    that shared it; now it is refused before any work, naming the field."""
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=5,
            extra_body=BEAMS | {"length_penalty": 1000},
        )  # fmt: skip
    body = error.value.response.json()["error"]
    assert body["param"] == "length_penalty" and body["code"] == 400
    assert "for max_tokens=5" in body["message"]
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=5, extra_body=BEAMS
    )
    assert [c.text for c in reply.choices] == offline_beams(llm, PROMPT, 2, 5)
