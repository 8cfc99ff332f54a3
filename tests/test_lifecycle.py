"""A request's life through the real engine: abort in every state, why it finished, and
refusals of requests that could never run. Nothing here may hang or leak a block."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sequence import FinishReason, SequenceStatus

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_A = {"prompt_token_ids": list(range(3, 13))}
PROMPT_B = {"prompt_token_ids": list(range(40, 47))}


def make_engine(model_path, **options):
    options = {"block_size": 4, "num_kv_blocks": 32, **options}
    return LLM(str(model_path), **options).llm_engine


def run_to_completion(engine, max_steps=500):
    """Step until idle; returns the final output of every request that finished."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"engine still busy after {max_steps} steps")


@pytest.fixture(scope="module")
def solo_outputs(tiny_llama_path):
    """Greedy tokens of each prompt run alone: what an abort must leave untouched."""
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    return {rid: out.outputs[0].token_ids for rid, out in run_to_completion(engine).items()}


def abort_and_check(engine, request_id):
    """Abort ``request_id``; its blocks must be back in the pool before the next step."""
    seq = engine.scheduler.requests[request_id]
    free_before = engine.kv_cache_manager.num_free_blocks
    num_blocks = len(seq.block_table)
    assert engine.abort_request(request_id) is True
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason is FinishReason.ABORT
    assert seq.block_table == []
    assert engine.kv_cache_manager.num_free_blocks == free_before + num_blocks
    assert request_id not in engine.scheduler.requests
    assert seq not in engine.scheduler.running and seq not in engine.scheduler.waiting


# --- abort in every state ---------------------------------------------------------------------


def test_abort_a_waiting_request(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path, max_num_seqs=1)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    engine.step()
    assert engine.scheduler.requests["b"].status is SequenceStatus.WAITING
    abort_and_check(engine, "b")
    finished = run_to_completion(engine)
    assert list(finished) == ["a"]
    assert finished["a"].outputs[0].token_ids == solo_outputs["a"]


def test_abort_a_request_in_the_middle_of_its_prefill(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path, max_num_batched_tokens=4)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    engine.step()
    seq = engine.scheduler.requests["a"]
    assert seq.status is SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < 10
    abort_and_check(engine, "a")
    finished = run_to_completion(engine)
    assert finished["b"].outputs[0].token_ids == solo_outputs["b"]
    assert engine.kv_cache_manager.num_free_blocks == 32


def test_abort_a_decoding_request(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path, async_scheduling=False)  # 3 steps: 3 tokens
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    for _ in range(3):
        engine.step()
    seq = engine.scheduler.requests["b"]
    assert seq.status is SequenceStatus.RUNNING and seq.num_output_tokens == 3
    abort_and_check(engine, "b")
    finished = run_to_completion(engine)
    assert list(finished) == ["a"]
    assert finished["a"].outputs[0].token_ids == solo_outputs["a"]


def test_abort_a_preempted_request(tiny_llama_path, solo_outputs):
    # 6 blocks of 4 tokens: both prompts fit (3 + 2 blocks), but not both with 8 outputs.
    engine = make_engine(tiny_llama_path, num_kv_blocks=6)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    for _ in range(20):
        engine.step()
        if engine.scheduler.num_preemptions:
            break
    seq = engine.scheduler.requests["b"]
    assert seq.status is SequenceStatus.PREEMPTED and seq.block_table == []
    abort_and_check(engine, "b")
    finished = run_to_completion(engine)
    assert finished["a"].outputs[0].token_ids == solo_outputs["a"]
    assert engine.kv_cache_manager.num_free_blocks == 6


def test_abort_with_prefix_caching_keeps_shared_blocks_for_the_other_owner(tiny_llama_path):
    engine = make_engine(tiny_llama_path, enable_prefix_caching=True, max_num_batched_tokens=8)
    shared = {"prompt_token_ids": list(range(3, 15)) + [50]}  # 3 full blocks + 1 token
    engine.add_request("a", shared, GREEDY)
    engine.step()  # "a" computes 8 tokens: 2 blocks registered
    engine.add_request("b", shared, GREEDY)
    # "a" computes its last 5 tokens: its third block is registered when the step is
    # scheduled, so "b", admitted after it in the same step, shares all three.
    engine.step()
    a, b = engine.scheduler.requests["a"], engine.scheduler.requests["b"]
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    shared_blocks = a.block_table[:3]
    engine.abort_request("a")
    allocator = engine.kv_cache_manager.allocator
    assert [allocator.ref_counts[block] for block in shared_blocks] == [1, 1, 1]
    finished = run_to_completion(engine)
    assert len(finished["b"].outputs[0].token_ids) == 8


def test_abort_unknown_finished_and_many_ids(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    assert engine.abort_request("never-added") is False
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    assert engine.abort_request(["a", "missing"]) == [True, False]
    assert engine.abort_request("a") is False  # twice: a no-op the second time
    run_to_completion(engine)
    assert engine.abort_request("b") is False  # already finished
    assert engine.kv_cache_manager.num_free_blocks == 32


def test_abort_from_a_streaming_loop_leaves_the_engine_usable(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    seen = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id] = output
            if output.request_id == "b" and len(output.outputs[0].token_ids) == 2:
                engine.abort_request("b")  # the client went away
    assert len(seen["b"].outputs[0].token_ids) == 2 and not seen["b"].finished
    assert seen["a"].outputs[0].token_ids == solo_outputs["a"]
    engine.add_request("b", PROMPT_B, GREEDY)  # the id is free again
    assert run_to_completion(engine)["b"].outputs[0].token_ids == solo_outputs["b"]


# --- why a request finished -------------------------------------------------------------------


def finish(engine, prompt, params):
    engine.add_request("r", prompt, params)
    return run_to_completion(engine)["r"].outputs[0]


def test_finish_reason_length_from_max_tokens(tiny_llama_path):
    out = finish(make_engine(tiny_llama_path), PROMPT_A, GREEDY)
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("length", None, 8)


def test_finish_reason_length_from_max_model_len(tiny_llama_path):
    engine = make_engine(tiny_llama_path, max_model_len=14)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = finish(engine, PROMPT_A, params)  # 10 prompt tokens: stops at 14 in all
    assert (out.finish_reason, len(out.token_ids)) == ("length", 4)


def test_finish_reason_stop_names_the_stop_token_id(tiny_llama_path, solo_outputs):
    stop_token = solo_outputs["a"][3]
    first = solo_outputs["a"].index(stop_token)
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_token])
    out = finish(make_engine(tiny_llama_path), PROMPT_A, params)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.token_ids == solo_outputs["a"][: first + 1]  # the stop token is kept


def test_finish_reason_stop_names_the_stop_string(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path)
    stop_word = engine.get_tokenizer().decode([solo_outputs["a"][2]])
    params = SamplingParams(temperature=0, max_tokens=8, stop=[stop_word])
    out = finish(engine, PROMPT_A, params)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_word)
    assert stop_word not in out.text.split()  # not included by default


def test_finish_reason_stop_on_eos_has_no_stop_reason(tiny_llama_path, solo_outputs):
    engine = make_engine(tiny_llama_path)
    # pretend the model's EOS
    engine.output_processor.eos_token_ids = frozenset({solo_outputs["a"][1]})
    out = finish(engine, PROMPT_A, SamplingParams(temperature=0, max_tokens=8))
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids[-1] == solo_outputs["a"][1]


# --- requests that could never run are refused up front ---------------------------------------


def test_a_duplicate_in_flight_request_id_is_refused(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", PROMPT_A, GREEDY)
    with pytest.raises(ValueError, match="request id 'a' is already in flight"):
        engine.add_request("a", PROMPT_B, GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    run_to_completion(engine)
    engine.add_request("a", PROMPT_B, GREEDY)  # finished ids may be reused


def test_a_finished_request_id_used_again_at_once_gets_its_own_blocks(tiny_llama_path):
    """The runner keeps each request's block table from step to step (the persistent input
    batch). An id reused in the very next step, with a table as long as the finished
    request's (5 blocks), must be computed in its own blocks: the old ones are free, and
    in a pool of 12 the request that joins beside it is given some of them."""
    longer = {"prompt_token_ids": list(range(60, 80))}  # 20 tokens: 5 blocks of 4
    alone = make_engine(tiny_llama_path, num_kv_blocks=12)
    alone.add_request("x", longer, GREEDY)
    alone.add_request("b", PROMPT_B, GREEDY)
    expected = {rid: out.outputs[0].token_ids for rid, out in run_to_completion(alone).items()}
    engine = make_engine(tiny_llama_path, num_kv_blocks=12)
    engine.add_request("a", PROMPT_A, GREEDY)  # 10 + 8 tokens: 5 blocks at the end
    run_to_completion(engine)
    engine.add_request("a", longer, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    finished = run_to_completion(engine)
    assert finished["a"].outputs[0].token_ids == expected["x"]
    assert finished["b"].outputs[0].token_ids == expected["b"]


def test_a_prompt_larger_than_the_whole_pool_names_both_numbers(tiny_llama_path):
    engine = make_engine(tiny_llama_path, num_kv_blocks=4)  # 16 tokens; max_model_len = 16
    with pytest.raises(ValueError, match=r"17 tokens and needs 5 KV blocks .* num_kv_blocks=4"):
        engine.add_request("big", {"prompt_token_ids": list(range(3, 20))}, GREEDY)
    assert not engine.has_unfinished_requests()
    assert finish(engine, PROMPT_B, GREEDY).finish_reason == "length"  # still serving


def test_requests_that_each_fill_the_pool_all_finish(tiny_llama_path):
    """Every request grows to need the whole pool: all four start together, then they can
    only go on by preempting each other, and must all finish, not livelock."""
    engine = make_engine(tiny_llama_path, num_kv_blocks=5)  # 20 tokens = max_model_len
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3 + i, 7 + i))}, params)
    finished = run_to_completion(engine)
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert all(len(o.outputs[0].token_ids) == 16 for o in finished.values())
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.num_free_blocks == 5
