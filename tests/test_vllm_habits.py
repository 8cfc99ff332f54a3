"""What a vLLM user types works here too, or is refused with a message that says what
to do instead: prompts as vLLM's ``TextPrompt`` dicts, ``minivllm serve MODEL``, the
bundled model's Hub id as the served name, ``--version``, tensor-parallel sizes, and
refusal messages that suggest commands which exist."""

from __future__ import annotations

import pytest

from minivllm import BeamSearchParams, SamplingParams

PROMPTS = ["w1 w2 w3", "w7 w8"]


def test_text_prompt_dicts_equal_plain_text(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    dicts = llm.generate([{"prompt": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in dicts] == PROMPTS
    one = llm.generate({"prompt": PROMPTS[0]}, params, use_tqdm=False)
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids

    beams = BeamSearchParams(beam_width=2, max_tokens=4)
    [want] = llm.beam_search(PROMPTS[0], beams)
    [got] = llm.beam_search({"prompt": PROMPTS[0]}, beams)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]

    with pytest.raises(ValueError, match="TextPrompt's prompt must be a str"):
        llm.generate({"prompt": 42}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt": ""}, params, use_tqdm=False)


def test_version_flag(capsys):
    from minivllm.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "minivllm 0.1.0"


def test_serve_takes_the_model_positionally(monkeypatch, capsys):
    """`minivllm serve MODEL` as `vllm serve MODEL`: the same as --model; two different
    models are refused in one line."""
    import minivllm.entrypoints.openai.api_server as api_server
    from minivllm.cli import main

    seen = []
    monkeypatch.setattr(api_server, "run_serve", lambda args, config: seen.append(config) or 0)
    assert main(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "9"]) == 0
    assert main(["serve", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 0
    assert seen[0] == seen[1] and seen[0].model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert main(["serve", "./a", "--model", "./b"]) == 2
    assert "two models given: './a' and --model './b'" in capsys.readouterr().err


def test_the_bundled_model_is_served_under_its_hub_id_too():
    from minivllm.entrypoints.openai.api_server import served_names

    hub, short = "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"
    assert served_names(None) == [short, hub]
    assert served_names(hub) == [hub, short]  # as vLLM: the --model given, first
    assert served_names(short) == [short, hub]
    assert served_names("./my-model") == ["./my-model"]


def test_unknown_model_404_lists_the_served_names(tiny_llama_path):
    import httpx

    from minivllm import EngineConfig, LLMEngine
    from minivllm.entrypoints.openai.api_server import BackgroundServer
    from tests.helpers import ENGINE_OPTIONS

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS))
    names = ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    with BackgroundServer(engine, model_name=names) as server:
        body = {"prompt": [5, 6], "max_tokens": 2}
        for name in names:  # either name works, and the reply names the one sent
            reply = httpx.post(server.url + "/v1/completions", json=body | {"model": name})
            assert reply.status_code == 200 and reply.json()["model"] == name
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == names
        reply = httpx.post(server.url + "/v1/completions", json=body | {"model": "gpt-4"})
        assert reply.status_code == 404
        assert reply.json()["error"]["message"] == (
            "The model `gpt-4` does not exist. Served: `SmolLM2-135M-Instruct`, "
            "`HuggingFaceTB/SmolLM2-135M-Instruct`."
        )


def test_errors_at_the_door_have_openais_shape(server):
    """`stream_options` without `stream` is a 400 (as vLLM); a body nested too deep to
    parse, an unknown route and a wrong method answer in OpenAI's error JSON, as every
    other error does (they used to be FastAPI's {"detail": ...})."""
    import httpx

    from tests.helpers import MODEL_NAME

    url = server.url + "/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "w1", "max_tokens": 2}
    for route in (url, server.url + "/v1/chat/completions"):
        request = body | {"stream_options": {"include_usage": True}}
        if "chat" in route:
            request = {k: v for k, v in request.items() if k != "prompt"}
            request["messages"] = [{"role": "user", "content": "w1"}]
        reply = httpx.post(route, json=request)
        assert reply.status_code == 400
        assert reply.json()["error"] == {
            "message": "stream_options can only be given with stream: true",
            "type": "BadRequestError",
            "param": "stream_options",
            "code": 400,
        }
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    assert httpx.post(url, json=streamed).status_code == 200
    assert httpx.post(url, json=body | {"stream_options": None}).status_code == 200

    deep = '{"prompt": ' + "[" * 3000 + "]" * 3000 + "}"
    headers = {"content-type": "application/json"}
    cases = [
        (httpx.post(url, content=deep, headers=headers), 400, "BadRequestError"),
        (httpx.get(server.url + "/nowhere"), 404, "NotFoundError"),
        (httpx.get(url), 405, "MethodNotAllowedError"),
    ]
    for reply, status, kind in cases:
        assert reply.status_code == status
        error = reply.json()["error"]
        assert error["code"] == status and error["type"] == kind and error["message"]
    assert "nested too deep" in cases[0][0].json()["error"]["message"]


def test_beam_text_is_the_output_alone_and_the_difference_is_documented(llm):
    """vLLM's offline beam text starts with the prompt; minivllm's is the output alone
    (what the HTTP choices carry): the docstring says so, and how to get vLLM's."""
    from minivllm.beam_search import BeamSearchSequence

    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    [out] = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        output_ids = [t for t in seq.tokens[len(prompt_ids) :] if t != tokenizer.eos_token_id]
        assert seq.text == tokenizer.decode(output_ids)
    doc = " ".join(BeamSearchSequence.__doc__.split())
    assert "here it is the output alone" in doc and "tokenizer.decode(seq.tokens)" in doc


def test_serve_without_its_extra_suggests_an_install_that_works_in_a_clone(monkeypatch, capsys):
    """minivllm is installed from its clone, not PyPI: `pip install 'minivllm[serve]'`
    would fail; `pip install -e ".[serve]"` in the clone works, and the extra exists."""
    import sys
    from pathlib import Path

    import tomllib

    from minivllm.cli import main

    monkeypatch.setitem(sys.modules, "minivllm.entrypoints.openai.api_server", None)
    assert main(["serve", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[serve]" in the minivllm clone' in err
    assert "minivllm[serve]" not in err
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert "serve" in pyproject["project"]["optional-dependencies"]
