"""Whole-engine greedy output is the same token for token whichever attention kernel runs.

A tiny token budget and block size make the engine mix prefill chunks (ending mid-block
and on block boundaries) with decodes in one step, so every kernel sees mixed batches.
numba-cuda runs in the CUDA simulator here (conftest.py), on a GPU under `make gpu-check`.
"""

from __future__ import annotations

import os

import pytest

from minivllm import LLM, SamplingParams

# numba-cuda runs where its kernel runs: the simulator takes CPU tensors.
CUDA_DEVICE = "cuda" if os.environ.get("MINIVLLM_REAL_GPU") == "1" else "cpu"

TINY_PROMPT_LENGTHS = [3, 9, 14]  # the simulator is slow: keep the token count small


def prompts(lengths: list[int]) -> list[dict]:
    return [
        {"prompt_token_ids": [1] + [(7 * i + 3 * j) % 250 + 3 for j in range(n - 1)]}
        for i, n in enumerate(lengths)
    ]


def greedy_token_ids(model: str, backend: str, prompt_list, max_tokens: int, **options):
    llm = LLM(model=model, attention_backend=backend, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_list, params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("backend", ["numba-cpu", "numba-cuda"])
def test_tiny_llama_greedy_equals_torch_backend(tiny_llama_path, backend: str) -> None:
    device = CUDA_DEVICE if backend == "numba-cuda" else "cpu"
    options = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, device=device)
    tiny = prompts(TINY_PROMPT_LENGTHS)
    expected = greedy_token_ids(str(tiny_llama_path), "torch", tiny, 6, **options)
    assert all(len(ids) == 6 for ids in expected)
    assert greedy_token_ids(str(tiny_llama_path), backend, tiny, 6, **options) == expected


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Continuous batching lets a server",
    "Once upon a time, in a small village by the sea,",
]


@pytest.mark.slow
def test_smollm2_greedy_numba_cpu_equals_torch_backend(smollm2_path) -> None:
    options = dict(block_size=16, max_num_batched_tokens=32, device="cpu", dtype="float32")
    expected = greedy_token_ids(str(smollm2_path), "torch", SMOLLM2_PROMPTS, 24, **options)
    got = greedy_token_ids(str(smollm2_path), "numba-cpu", SMOLLM2_PROMPTS, 24, **options)
    assert got == expected
