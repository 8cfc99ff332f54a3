"""Parallel sampling (``n > 1``): one parent request, ``n`` children sharing the prompt's
KV blocks, their outputs gathered back into one `RequestOutput`."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import RequestOutputKind

PROMPT = {"prompt_token_ids": list(range(3, 3 + 37))}  # 4 full blocks of 8 and 5 tokens
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64)


def run_logged(llm, prompt, params):
    """generate() with the engine's step records on; returns (output, step records)."""
    engine = llm.llm_engine
    engine.record_steps()
    try:
        [output] = llm.generate(prompt, params, use_tqdm=False)
    finally:
        steps = engine.take_step_stats()
    return output, steps


def test_n_must_be_a_positive_int():
    with pytest.raises(ValueError, match="n must be at least 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an int"):
        SamplingParams(n=2.5)
    with pytest.raises(ValueError, match="seed \\+ n - 1 must fit in 64 bits"):
        SamplingParams(n=2, seed=2**64 - 1)
    with pytest.raises(TypeError, match="best_of"):  # vLLM v1 removed it
        SamplingParams(n=2, best_of=4)


def test_n_beyond_max_num_seqs_is_refused_before_anything_is_queued(llm):
    engine = llm.llm_engine
    n = engine.config.max_num_seqs + 1
    with pytest.raises(ValueError, match=f"n={n} is more than max_num_seqs"):
        engine.add_request("big", PROMPT, SamplingParams(n=n))
    with pytest.raises(ValueError, match="n=1000000000000000000000000000000 is more"):
        engine.add_request("huge", PROMPT, SamplingParams(n=10**30))
    assert not engine.has_unfinished_requests()


def test_greedy_n4_gives_four_identical_choices_indexed_0_to_3(llm):
    params = SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True)
    output, _ = run_logged(llm, PROMPT, params)
    [single] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)  # fmt: skip
    assert output.finished and output.request_id.isdigit()
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single.outputs[0].token_ids for c in output.outputs)
    assert all(c.finish_reason == "length" for c in output.outputs)


def test_seeded_child_i_equals_a_lone_request_with_seed_plus_i(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    singles = llm.generate(
        [PROMPT] * 3,
        [SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=8, ignore_eos=True)
         for i in range(3)],
        use_tqdm=False,
    )  # fmt: skip
    assert [c.token_ids for c in output.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # really different samples


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_the_prompt_is_computed_once_and_its_blocks_shared(tiny_llama_path, enable_prefix_caching):
    """The children share the prompt's 4 full blocks (the first child computes them, the
    others hit them in the same step); each child computes only the last partial block,
    whose tokens it will go on writing after. Prefix caching on or off alike."""
    llm = LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64,
              enable_prefix_caching=enable_prefix_caching)  # fmt: skip
    params = SamplingParams(n=4, temperature=0, max_tokens=2, ignore_eos=True)
    _, steps = run_logged(llm, PROMPT, params)
    prompt_len, num_full = 37, 37 // BLOCK_SIZE
    assert steps[0].num_prefill_tokens == prompt_len + 3 * (prompt_len - num_full * BLOCK_SIZE)
    assert len(steps[0].prefill_ids) == 4  # all four children admitted in one step
    # Blocks: 4 shared + one partial block per child, against 4 x 5 unshared.
    assert steps[0].num_kv_blocks_used == num_full + 4
    assert sum(s.num_prefill_tokens for s in steps) == steps[0].num_prefill_tokens


def test_blocks_shared_across_steps_when_the_prompt_is_chunked(tiny_llama_path):
    """A prompt longer than the step's token budget: the siblings hit what is registered
    when they are admitted and still compute no full block twice."""
    llm = LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64,
              max_num_batched_tokens=16)  # fmt: skip
    params = SamplingParams(n=3, temperature=0, max_tokens=3, ignore_eos=True)
    output, steps = run_logged(llm, PROMPT, params)
    assert sum(s.num_prefill_tokens for s in steps) == 37 + 2 * 5
    [single] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)  # fmt: skip
    assert all(c.token_ids == single.outputs[0].token_ids for c in output.outputs)


def test_engine_delta_reports_each_step_the_children_that_produced_something(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    engine.add_request("p", PROMPT, params)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "p"
            assert sorted(c.index for c in output.outputs) == [c.index for c in output.outputs]
            for c in output.outputs:
                tokens[c.index] += c.token_ids
            finished.append(output.finished)
    assert finished[-1] and not any(finished[:-1])
    assert all(len(t) == 4 for t in tokens.values()) and tokens[0] == tokens[1] == tokens[2]


def test_engine_final_only_reports_once_with_all_children(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=3,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engine.add_request("q", PROMPT, params)
    reports = []
    while engine.has_unfinished_requests():
        reports += engine.step()
    assert len(reports) == 1 and reports[0].finished
    assert [c.index for c in reports[0].outputs] == [0, 1]


def test_abort_of_the_parent_aborts_every_child_and_frees_every_block(llm):
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    free_before = kv.num_free_blocks
    engine.add_request("r", PROMPT, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("r", PROMPT, SamplingParams())
    engine.step()
    engine.step()
    assert kv.num_free_blocks < free_before
    assert engine.abort_request("r") is True
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == free_before
    assert kv.allocator.ref_counts == [0] * kv.num_blocks
    assert engine.abort_request("r") is False
    assert engine.step() == []


def test_chat_with_n(llm):
    """LLM.chat goes through the same fan-out: one output per conversation, n choices."""
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    try:
        params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True)
        conversations = [[{"role": "user", "content": "w5 w6 w7"}]] * 2
        outputs = llm.chat(conversations, params, use_tqdm=False)
    finally:
        tokenizer.chat_template = None
    assert [len(o.outputs) for o in outputs] == [2, 2]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[1].token_ids
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_preempting_children_never_corrupts_a_siblings_shared_blocks(tiny_llama_path):
    """A pool too small for four children's outputs: children are preempted and
    recomputed while their siblings keep reading the shared prompt blocks; every greedy
    choice still equals a lone request run with room to spare."""
    prompt = {"prompt_token_ids": list(range(3, 16))}  # 3 full blocks of 4 + 1 token
    params = SamplingParams(n=4, temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=16, max_num_batched_tokens=16)
    [output] = llm.generate(prompt, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    roomy = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=64)
    [single] = roomy.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                     ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in output.outputs] == [single.outputs[0].token_ids] * 4
    assert llm.llm_engine.kv_cache_manager.allocator.ref_counts == [0] * 16


def test_static_policy_fans_out_without_sharing(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=64,
              scheduling_policy="static")  # fmt: skip
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    output, steps = run_logged(llm, PROMPT, params)
    assert steps[0].num_prefill_tokens == 2 * 37  # each child its own region, own prefill
    lone = [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=4, ignore_eos=True)
            for i in range(2)]  # fmt: skip
    singles = llm.generate([PROMPT] * 2, lone, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [s.outputs[0].token_ids for s in singles]


def test_engine_cumulative_reports_all_n_choices_as_they_stand(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=0, max_tokens=3, ignore_eos=True)  # CUMULATIVE
    engine.add_request("c", PROMPT, params)
    lengths = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert [c.index for c in output.outputs] == [0, 1, 2]
            lengths.append([len(c.token_ids) for c in output.outputs])
    assert lengths[-1] == [3, 3, 3]
    assert all(a <= b for prev, cur in zip(lengths, lengths[1:]) for a, b in zip(prev, cur))


@pytest.mark.slow
def test_smollm2_n4_greedy_equals_one_request(smollm2_path):
    """On the real model the children read the prompt's keys and values that a sibling
    wrote in the same step: greedy choices still equal a lone request's, token for token."""
    llm = LLM(str(smollm2_path), num_kv_blocks=128)
    prompt = "Explain in two sentences why the sky is blue."
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    [output] = llm.generate(prompt, SamplingParams(n=4, **greedy), use_tqdm=False)
    assert llm.llm_engine.reset_prefix_cache()  # the lone request computes everything
    [single] = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)
    assert single.num_cached_tokens == 0
    assert output.num_cached_tokens == 0  # child 0 computed the prompt; the others hit it
    assert [c.token_ids for c in output.outputs] == [single.outputs[0].token_ids] * 4
