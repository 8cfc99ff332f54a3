"""Bad input raises a ValueError naming the bad value, before any work starts, and an
engine that refused one request keeps serving the others."""

import json

import pytest

from minivllm import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), num_kv_blocks=16, block_size=4, max_model_len=40)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature must be finite and >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "got 1.5"),
        ({"top_k": -3}, "top_k .* got -3"),
        ({"top_k": 2.5}, "top_k .* got 2.5"),
        ({"min_p": 2.0}, "min_p .* got 2.0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"n": 2}, "n must be 1"),
        ({"stop": [""]}, "stop strings"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids .* \[-1\]"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_kv_blocks": 0}, "num_kv_blocks must be a positive int or None, got 0"),
        ({"block_size": 0}, "block_size must be a positive int, got 0"),
        ({"max_num_seqs": -1}, "max_num_seqs must be a positive int, got -1"),
        ({"attention_backend": "nope"}, "unknown attention backend 'nope'; available: .*torch"),
        ({"dtype": "float8"}, "unknown dtype 'float8'"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_bad_engine_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="not a local Hugging Face checkpoint"):
        LLM(model=str(tmp_path / "missing"))


def test_unsupported_architecture_lists_supported(tiny_llama_path, tmp_path):
    config = json.loads((tiny_llama_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*Qwen3"):
        LLM(model=str(tmp_path))


def test_max_model_len_larger_than_cache(tiny_llama_path):
    with pytest.raises(ValueError, match="max_model_len=100 does not fit .* 64 tokens"):
        LLM(model=str(tiny_llama_path), num_kv_blocks=16, block_size=4, max_model_len=100)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, r"prompt is empty \(0 tokens\)"),
        ({"prompt_token_ids": [1, 256, 3]}, r"token ids \[256\] are outside the vocabulary"),
        ({"prompt_token_ids": [1, -4]}, r"\[-4\] are outside"),
        ({"prompt_token_ids": [5] * 41}, "prompt has 41 tokens, more than max_model_len=40"),
        (42, "a prompt must be a str"),
    ],
)
def test_bad_prompt_is_refused_and_others_still_served(llm, prompt, match):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 5, 6]}, prompt], params, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # nothing half-queued was left behind
    [out] = llm.generate([{"prompt_token_ids": [1, 5, 6]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["w1", "w2"], [SamplingParams()], use_tqdm=False)


def test_cli_reports_bad_value_without_traceback(capsys):
    from minivllm.cli import main

    assert main(["generate", "hi", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1], got 0.0" in capsys.readouterr().err
