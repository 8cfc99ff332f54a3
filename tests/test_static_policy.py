"""The static batching policy: same outputs as continuous, waste counted exactly, batches
closed to newcomers, whole KV regions reserved. All on the tiny random Llama."""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.utils import cdiv

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def make_engine(path, policy: str, max_num_seqs: int = 3, num_kv_blocks: int = 64) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            scheduling_policy=policy,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=16,
            # The prompts share their first tokens: every row counted here is computed.
            enable_prefix_caching=False,
            # Rows counted step by step: none of async scheduling's decodes thrown away.
            async_scheduling=False,
        )
    )
    engine.record_steps()
    return engine


def exact(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def add(engine: LLMEngine, request_id: str, prompt_len: int, max_tokens: int) -> None:
    prompt = {"prompt_token_ids": [3 + (7 * i + len(request_id)) % 250 for i in range(prompt_len)]}
    engine.add_request(request_id, prompt, exact(max_tokens))


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_static_greedy_outputs_equal_continuous(tiny_llama_path):
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]}
        for _ in range(8)
    ]
    params = [exact(rng.randint(1, 20)) for _ in prompts]
    outputs = {}
    for policy in ("continuous", "static"):
        llm = LLM(
            str(tiny_llama_path),
            scheduling_policy=policy,
            max_num_seqs=3,
            num_kv_blocks=64,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=16,
        )
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[policy] = [r.outputs[0].token_ids for r in results]
    assert outputs["static"] == outputs["continuous"]
    assert [len(o) for o in outputs["static"]] == [p.max_tokens for p in params]


def test_padding_slots_are_counted_exactly(tiny_llama_path):
    engine = make_engine(tiny_llama_path, "static")
    prompt_lens, output_lens = [5, 9, 3], [4, 2, 6]
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
        add(engine, str(i), p, o)
    run_to_end(engine)
    steps = engine.engine_stats.recorded

    # Step 1 prefills all three padded to 9 tokens: 4 + 0 + 6 padding rows.
    assert steps[0].num_prefill_tokens == 17
    assert steps[0].num_padding_tokens == 10
    # Then 6 - 1 = 5 lockstep decode steps of 3 slots each; real decodes: 3 + 1 + 5.
    decode_steps = steps[1:]
    assert len(decode_steps) == 5
    assert all(s.num_decode_tokens + s.num_padding_tokens == 3 for s in decode_steps)
    assert sum(s.num_decode_tokens for s in decode_steps) == 9
    assert sum(s.num_padding_tokens for s in decode_steps) == 15 - 9
    # Request 1 (2 tokens) is done after decode step 1 and pads from step 2 on.
    assert [s.padding_ids.count("1") for s in decode_steps] == [0, 1, 1, 1, 1]


def test_continuous_computes_no_padding(tiny_llama_path):
    engine = make_engine(tiny_llama_path, "continuous")
    for i, (p, o) in enumerate(zip([5, 9, 3], [4, 2, 6])):
        add(engine, str(i), p, o)
    run_to_end(engine)
    assert sum(s.num_padding_tokens for s in engine.engine_stats.recorded) == 0
    assert sum(s.num_prefill_tokens for s in engine.engine_stats.recorded) == 17
    assert sum(s.num_decode_tokens for s in engine.engine_stats.recorded) == 3 + 1 + 5


def test_static_never_admits_into_a_running_batch(tiny_llama_path):
    engine = make_engine(tiny_llama_path, "static", max_num_seqs=4)
    add(engine, "a", 6, 8)
    add(engine, "b", 4, 2)
    engine.step()  # the batch {a, b} starts
    add(engine, "late", 3, 3)  # a slot is free, but the batch is closed
    first_batch = {"a", "b"}
    while engine.scheduler.requests.keys() & first_batch:
        engine.step()
        assert {s.request_id for s in engine.scheduler.running} <= first_batch
        last = engine.last_stats
        assert "late" not in last.prefill_ids + last.decode_ids
    engine.step()
    assert engine.engine_stats.recorded[-1].prefill_ids == ["late"]
    run_to_end(engine)


def test_static_reserves_a_max_model_len_region_per_request(tiny_llama_path):
    region = cdiv(MAX_MODEL_LEN, BLOCK_SIZE)  # 16 blocks
    # Room for two regions only: the third request waits although max_num_seqs is 4.
    engine = make_engine(tiny_llama_path, "static", max_num_seqs=4, num_kv_blocks=2 * region + 3)
    for i in range(3):
        add(engine, str(i), 5, 3)
    engine.step()
    running = engine.scheduler.running
    assert [s.request_id for s in running] == ["0", "1"]
    assert all(len(s.block_table) == region for s in running)
    assert engine.engine_stats.recorded[-1].num_kv_blocks_used == 2 * region
    run_to_end(engine)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_aborted_member_keeps_padding_until_the_batch_ends(tiny_llama_path):
    engine = make_engine(tiny_llama_path, "static")
    add(engine, "long", 4, 6)
    add(engine, "aborted", 4, 6)
    engine.step()
    engine.abort_request("aborted")
    run_to_end(engine)
    assert all(s.padding_ids == ["aborted"] for s in engine.engine_stats.recorded[1:])
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_policy_is_validated():
    with pytest.raises(ValueError, match="continuous, static"):
        EngineConfig(scheduling_policy="dynamic")
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(scheduling_policy="static", enable_prefix_caching=True)
