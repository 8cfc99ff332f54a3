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
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"stop": [""]}, "stop strings"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids .* \[-1\]"),
        ({"stop": ["w"] * 129}, "stop has 129 strings, more than the 128 allowed"),
        ({"stop": ["w" * 257]}, "stop strings may have at most 256 characters, got one of 257"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be finite and >= 0.01"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in"),
        ({"logit_bias": {3: -100.5}}, "logit_bias maps token ids"),
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


# --- values that used to pass validation and crash inside torch, or pass silently -----------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_k": True}, "top_k must be an int, got True"),
        ({"stop_token_ids": [2, False]}, "stop_token_ids must be an int, got False"),
        ({"seed": 2**64}, f"seed must fit in 64 bits, got {2**64}"),
        ({"seed": -(2**63) - 1}, "seed must fit in 64 bits"),
        ({"seed": 1.5}, "seed must be an int, got 1.5"),
        ({"max_tokens": 2.5}, "max_tokens must be an int, got 2.5"),
        ({"min_tokens": "3"}, "min_tokens must be an int, got '3'"),
        ({"temperature": float("inf")}, "temperature must be finite and >= 0, got inf"),
        ({"temperature": float("nan")}, "temperature must be finite and >= 0, got nan"),
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
        ({"top_p": True}, "top_p must be a number, got True"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind"),
        ({"stop": 5}, "stop must be a list, got 5"),
        ({"stop_token_ids": 2}, "stop_token_ids must be a list, got 2"),
    ],
)
def test_bad_sampling_values_that_torch_would_choke_on(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_and_torch_integers_are_ints():
    import numpy as np
    import torch

    params = SamplingParams(
        top_k=np.int64(5), seed=torch.tensor(7), max_tokens=3.0, stop_token_ids=[np.int32(9)]
    )
    assert (params.top_k, params.seed, params.max_tokens, params.stop_token_ids) == (5, 7, 3, [9])
    assert all(type(v) is int for v in (params.top_k, params.seed, params.max_tokens))
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # what torch accepts


def test_temperature_below_epsilon_is_greedy(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tiny = SamplingParams(temperature=1e-9, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 5, 6]}]
    [a], [b] = (llm.generate(prompt, p, use_tqdm=False) for p in (greedy, tiny))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([1, True, 3], r"prompt token ids must be ints, got \[True\]"),
        ([1, 2.5], r"must be ints, got \[2.5\]"),
        ([1, "5"], r"must be ints, got \['5'\]"),
        ("w1 w2", "prompt_token_ids must be a list of ints, got 'w1 w2'"),
        (7, "prompt_token_ids must be a list of ints, got 7"),
    ],
)
def test_bad_prompt_token_ids(llm, token_ids, match):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", {"prompt_token_ids": token_ids}, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_numpy_and_torch_prompt_ids_are_accepted(llm):
    import numpy as np
    import torch

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": ids}
        for ids in ([1, 5, 6], np.array([1, 5, 6]), torch.tensor([1, 5, 6]), [np.int64(1), 5, 6])
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.prompt_token_ids == [1, 5, 6] for o in outputs)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1


def test_abort_accepts_what_add_request_accepted(llm):
    engine = llm.llm_engine
    engine.add_request(7, {"prompt_token_ids": [1, 5, 6]}, SamplingParams(max_tokens=4))
    engine.add_request("8", {"prompt_token_ids": [1, 5, 6]}, SamplingParams(max_tokens=4))
    assert engine.abort_request(7) is True
    assert engine.abort_request([8, "nope"]) == [True, False]
    assert not engine.has_unfinished_requests()


def test_engine_config_refuses_bools_and_huge_seeds():
    with pytest.raises(ValueError, match="block_size must be a positive int, got True"):
        EngineConfig(block_size=True)
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        EngineConfig(seed=2**64)


# --- the command line: argparse's error line and exit code 2, before any work -----------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "hi", "--max-tokens", "2.5"],
            "argument --max-tokens: expected int, got '2.5'",
        ),
        (["generate", "hi", "--max-tokens", "0"], "argument --max-tokens: must be a positive int"),
        (["generate", "hi", "--temperature", "nan"], "argument --temperature: must be a finite"),
        (["generate", "hi", "--sampling-seed", str(2**64)], "--sampling-seed: must fit in 64 bits"),
        (["generate", "hi", "--stop", ""], "argument --stop: must not be empty"),
        (["generate", "hi", "--block-size", "0"], "--block-size: must be a positive int, got '0'"),
        (["generate", "hi", "--num-kv-blocks", "-3"], "--num-kv-blocks: must be a positive int"),
        (["bench", "--max-concurrency", "-1"], "--max-concurrency: must be a positive int"),
        (["bench", "--threads", "0"], "argument --threads: must be a positive int, got '0'"),
        (["bench", "--policy", ",,"], "no scheduling policy in ',,'"),
        (["bench", "--policy", "static,dynamic"], "unknown scheduling policy 'dynamic'"),
        (["bench", "--prompt-len", "inf"], "argument --prompt-len: bad length distribution 'inf'"),
        (["bench", "--output-len", "uniform:0:4"], "argument --output-len: bad length"),
        (["bench", "--dataset", "/nonexistent.jsonl"], "--dataset: no such file"),
        (["bench", "--num-prompts", "0"], "argument --num-prompts: must be a positive int"),
        (["bench", "--request-rate", "nan"], "argument --request-rate: must be a positive number"),
        (["bench", "--request-rate", "0"], "argument --request-rate: must be a positive number"),
    ],
)
def test_bad_flag_is_an_argparse_error(argv, message, capsys):
    from minivllm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"minivllm {argv[0]}: error: " in err and message in err
    assert "Traceback" not in err
