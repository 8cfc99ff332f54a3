"""Greedy output equals Hugging Face transformers token for token.

transformers runs each prompt alone (no padding), which is the ground truth; minivllm runs
all prompts together as one continuous batch, in every scheduling regime: roomy, chunked
prefill (tiny token budget) and preemption (tiny KV pool)."""

import pytest
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from tests.helpers import hf_greedy

MAX_TOKENS = 12


def _prompts(lengths):
    return [[1] + [(7 * i + 3 * j) % 250 + 3 for j in range(n - 1)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def hf_reference(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    prompts = _prompts([1, 5, 17, 33, 64, 9])
    return tiny_model_path, prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def _generate(path, prompts, **options):
    """Greedy ids of every prompt, run as one batch, and the engine's per-step record."""
    llm = LLM(model=str(path), **options)
    llm.llm_engine.record_steps()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def _prefill_chunks(llm) -> dict[str, int]:
    """How many steps computed part of each request's prompt (or recompute)."""
    chunks: dict[str, int] = {}
    for step in llm.llm_engine.engine_stats.recorded:
        for request_id in step.prefill_ids:
            chunks[request_id] = chunks.get(request_id, 0) + 1
    return chunks


def test_roomy_batch_matches_transformers(hf_reference):
    path, prompts, expected = hf_reference
    llm, got = _generate(path, prompts, block_size=4, num_kv_blocks=256)
    assert got == expected
    engine = llm.llm_engine
    # Roomy: every prompt in one chunk, in the first step, and nobody preempted.
    assert set(_prefill_chunks(llm).values()) == {1}
    assert len(engine.engine_stats.recorded[0].prefill_ids) == len(prompts)
    assert engine.scheduler.num_preemptions == 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_chunked_prefill_matches_transformers(hf_reference):
    """A 7-token budget cuts every longer prompt into chunks that end mid-block and on
    block boundaries (block_size 7 and 4 alternate the two cases)."""
    path, prompts, expected = hf_reference
    for block_size in (4, 7):
        llm, got = _generate(
            path, prompts, block_size=block_size, num_kv_blocks=256, max_num_batched_tokens=7
        )
        assert got == expected, f"block_size={block_size}"
        # The chunking really happened: no step ran more than 7 tokens, and each prompt
        # took ceil(len / 7) prefill steps at least (the 64-token one: 10).
        steps = llm.llm_engine.engine_stats.recorded
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) == 7
        chunks = _prefill_chunks(llm)
        assert all(chunks[str(i)] >= -(-len(p) // 7) for i, p in enumerate(prompts))
        assert llm.llm_engine.scheduler.num_preemptions == 0


def test_preemption_matches_transformers(hf_reference):
    """So few blocks that requests must be evicted and recomputed, yet outputs are exact.
    Prefix caching off: with it, a readmitted request finds its own freed blocks still
    cached and skips the recompute this test is about (outputs exact either way)."""
    path, prompts, expected = hf_reference
    squeezed = dict(block_size=4, num_kv_blocks=24, max_model_len=96)
    _, cached = _generate(path, prompts, **squeezed)  # the default: prefix caching on
    assert cached == expected
    llm, got = _generate(path, prompts, enable_prefix_caching=False, **squeezed)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    preempted = {rid for step in engine.engine_stats.recorded for rid in step.preempted_ids}
    # A preempted request was recomputed: one more prefill than its prompt needed.
    assert preempted and all(_prefill_chunks(llm)[rid] >= 2 for rid in preempted)
    assert got == expected
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_text_equals_decoded_tokens(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate(["w5 w6 w7"], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer("w5 w6 w7").input_ids
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length" and out.finished


SMOL_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Continuous batching lets a server " * 12,  # ~100 tokens
    "1, 2, 3,",
]


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path):
    """The real model: a batch of prompts of different lengths, greedy, 24 tokens each,
    run with chunked prefill and preemption pressure at the same time."""
    llm = LLM(model=str(smollm2_path), num_kv_blocks=20, block_size=8, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24), out.prompt
