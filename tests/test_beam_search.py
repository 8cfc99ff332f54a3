"""Beam search equals transformers' ``generate(num_beams=k)``, beam for beam.

Like vLLM's own beam-search test: the ``k`` returned beams (token ids and order) equal
transformers' ``num_return_sequences=k`` for the real SmolLM2 (fp32, chat prompts), and,
on a tiny random Llama, under every scheduling regime (a tight pool that preempts beams,
a token budget smaller than the beams, sharing off). Then what the engine promises
around it: EOS and ``ignore_eos``, the length penalty, every block back after a search or
an abort, fewer blocks with sharing than without, bad parameters refused up front.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    EngineConfig,
    LLMEngine,
    SamplingParams,
)
from minivllm.chat import chat_prompt

MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three colors.",
]


def hf_beams(model, prompt_ids, k, max_tokens, length_penalty=1.0, eos_token_id=2):
    """transformers' ``k`` best beams, output tokens only, each cut after its EOS (the
    shorter ones come back padded with the pad id, which is EOS for these models)."""
    generated = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    beams = []
    for row in generated.tolist():
        output = row[len(prompt_ids) :]
        beams.append(output[: output.index(eos_token_id) + 1] if eos_token_id in output else output)
    return beams


def output_tokens(out: BeamSearchOutput, prompt_ids) -> list[list[int]]:
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids  # vLLM's: the prompt included
    return [seq.tokens[len(prompt_ids) :] for seq in out.sequences]


def assert_every_block_free(llm):
    manager = llm.llm_engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.allocator.ref_counts == [0] * manager.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


# --- the real model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    llm = LLM(str(smollm2_path), dtype="float32", block_size=4, num_kv_blocks=512)
    prompts = [chat_prompt(llm.get_tokenizer(), [{"role": "user", "content": m}]) for m in MESSAGES]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    return llm, hf, prompts


@pytest.mark.parametrize("beam_width", [2, 4])
def test_smollm2_beams_equal_transformers(smollm2, beam_width):
    llm, hf, prompts = smollm2
    params = BeamSearchParams(beam_width=beam_width, max_tokens=12)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        ids = prompt["prompt_token_ids"]
        assert output_tokens(out, ids) == hf_beams(hf, ids, beam_width, 12)
    assert_every_block_free(llm)


def test_smollm2_length_penalty_changes_the_ranking_as_in_transformers(smollm2):
    """A penalty below 1 favours short beams, above 1 long ones; both rankings equal
    transformers'. The France prompt has beams ending at EOS at different lengths."""
    llm, hf, prompts = smollm2
    ids = prompts[0]["prompt_token_ids"]
    by_penalty = {}
    for penalty in (0.0, 2.0):
        params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty)
        [out] = llm.beam_search(prompts[0], params)
        by_penalty[penalty] = output_tokens(out, ids)
        assert by_penalty[penalty] == hf_beams(hf, ids, 3, 12, length_penalty=penalty)
    assert by_penalty[0.0] != by_penalty[2.0]


def test_smollm2_eos_ends_a_beam_and_leaves_the_text(smollm2):
    llm, _, prompts = smollm2
    tokenizer = llm.get_tokenizer()
    [out] = llm.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=12))
    best = out.sequences[0]
    assert best.tokens[-1] == tokenizer.eos_token_id and best.finish_reason == "stop"
    assert best.text == "The capital of France is Paris."  # no EOS in the text
    # cum_logprob is the sum of the chosen tokens' logprobs, one dict per output token.
    ids = prompts[0]["prompt_token_ids"]
    chosen = [row[t].logprob for t, row in zip(best.tokens[len(ids) :], best.logprobs)]
    assert len(best.logprobs) == len(best.tokens) - len(ids)
    assert best.cum_logprob == pytest.approx(math.fsum(chosen), abs=1e-4)

    [out] = llm.beam_search(
        prompts[0], BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)
    )
    for seq in out.sequences:  # nothing stops before max_tokens
        assert len(seq.tokens) == len(ids) + 12 and seq.finish_reason == "length"


# --- a tiny model, every scheduling regime -----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return tiny_llama_path, AutoModelForCausalLM.from_pretrained(tiny_llama_path)


REGIMES = {
    "roomy": dict(block_size=4, num_kv_blocks=256),
    "preempting": dict(block_size=2, num_kv_blocks=24, max_model_len=40),
    "small budget": dict(block_size=3, num_kv_blocks=256, max_num_batched_tokens=3),
    "no sharing": dict(block_size=4, num_kv_blocks=256, share_forked_blocks=False),
    "no prefix caching": dict(block_size=4, num_kv_blocks=256, enable_prefix_caching=False),
    # The others run with the default, async scheduling, which steps without overlap while
    # a beam search is in flight; this one never overlaps.
    "no async scheduling": dict(block_size=4, num_kv_blocks=256, async_scheduling=False),
}


@pytest.fixture(scope="module")
def tiny_engines(tiny):
    path, _ = tiny
    return {name: LLM(str(path), **options) for name, options in REGIMES.items()}


@settings(max_examples=12, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(3, 255), min_size=1, max_size=12), min_size=1, max_size=3
    ),
    beam_width=st.integers(1, 4),
    max_tokens=st.integers(1, 10),
    length_penalty=st.sampled_from([1.0, 0.0, 0.5, 2.0]),
    regime=st.sampled_from(sorted(REGIMES)),
)
def test_tiny_model_beams_equal_transformers_in_every_regime(
    tiny, tiny_engines, prompts, beam_width, max_tokens, length_penalty, regime
):
    """Several prompts searched at once, their beams forked, dropped, preempted and
    recomputed, or scheduled a few at a time: always transformers' beams."""
    _, hf = tiny
    llm = tiny_engines[regime]
    params = BeamSearchParams(beam_width, max_tokens, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        expected = hf_beams(hf, prompt, beam_width, max_tokens, length_penalty)
        assert output_tokens(out, prompt) == expected
    assert_every_block_free(llm)


def test_beams_are_preempted_and_copied_on_write_in_the_tight_regime(tiny, tiny_engines):
    """The tight regime above really preempts beams and copies blocks on write, and the
    beams still equal those of the roomy pool."""
    llm = tiny_engines["preempting"]
    engine = llm.llm_engine
    prompts = [[5 + i, 9, 30 + i, 7, 8] for i in range(3)]
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    for i, prompt in enumerate(prompts):
        engine.add_beam_search_request(f"tight{i}", {"prompt_token_ids": prompt}, params)
    preemptions, copies, outputs = engine.scheduler.num_preemptions, 0, {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
        copies += len(engine.last_step.blocks_to_copy)
    assert engine.scheduler.num_preemptions > preemptions and copies > 0
    expected = tiny_engines["roomy"].beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for i, out in enumerate(expected):
        assert [c.token_ids for c in outputs[f"tight{i}"].outputs] == output_tokens(out, prompts[i])
    assert_every_block_free(llm)


def test_sharing_holds_fewer_blocks_than_copying_with_the_same_beams(tiny):
    """PagedAttention's point: with sharing, forks hold their parent's blocks once; with
    the knob off each beam holds its own copies. Same beams either way."""
    path, _ = tiny
    prompt = {"prompt_token_ids": list(range(3, 40))}  # 37 tokens: 10 blocks of 4
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    peak, beams, copies = {}, {}, {}
    for share in (True, False):
        llm = LLM(str(path), block_size=4, num_kv_blocks=256, share_forked_blocks=share)
        engine = llm.llm_engine
        engine.add_beam_search_request("r", prompt, params)
        peak[share] = copies[share] = 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            copies[share] += len(engine.last_step.blocks_to_copy)
            used = engine.num_kv_blocks - engine.kv_cache_manager.num_free_blocks
            peak[share] = max(peak[share], used)
        [out] = outputs
        beams[share] = [c.token_ids for c in out.outputs]
        assert_every_block_free(llm)
    assert beams[True] == beams[False]
    assert peak[True] < peak[False]
    assert 0 < copies[True] < copies[False]  # only partial blocks are copied with sharing


def test_abort_frees_every_beam(tiny):
    path, _ = tiny
    llm = LLM(str(path), block_size=4, num_kv_blocks=256)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    engine.add_beam_search_request("r", prompt, BeamSearchParams(4, 20))
    for _ in range(4):
        assert engine.step() == []
    assert len(engine.request_groups["beam_search"].groups["r"].beams) == 4
    assert engine.kv_cache_manager.num_free_blocks < engine.num_kv_blocks
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_beam_search_request("r", {"prompt_token_ids": [5]}, BeamSearchParams(2, 2))
    a_beam = engine.request_groups["beam_search"].groups["r"].beam_ids[-1]
    assert engine.abort_request(a_beam) is False  # a beam alone is not a request
    assert engine.abort_request("r") is True
    assert engine.abort_request("r") is False
    assert_every_block_free(llm)
    beams = engine.request_groups["beam_search"]
    assert "r" not in beams and not beams.group_of


@pytest.mark.parametrize("regime", ["roomy", "preempting"])
def test_each_beam_token_and_the_prompt_are_counted_once_in_the_step_stats(tiny, regime):
    """The per-step counters behind /metrics: one generated token per live beam per
    round, the prompt once; a beam recomputed after preemption is not counted again."""
    path, _ = tiny
    llm = LLM(str(path), **REGIMES[regime])
    engine = llm.llm_engine
    engine.record_steps()
    prompts = [list(range(3, 12)), list(range(20, 26)), [5, 9, 30, 7, 8]]  # 9, 6, 5 tokens
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_beam_search_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    preemptions = engine.scheduler.num_preemptions
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(s.num_prompt_tokens for s in engine.engine_stats.recorded) == 9 + 6 + 5
    # Round 1: the one first beam; rounds 2-8: four beams each.
    assert sum(s.num_generation_tokens for s in engine.engine_stats.recorded) == 3 * (1 + 4 * 7)
    if regime == "preempting":
        assert engine.scheduler.num_preemptions > preemptions


@pytest.mark.slow  # two worker processes start
def test_two_tensor_parallel_ranks_copy_blocks_too(tiny, tiny_engines):
    """The copies travel to every rank with the step: beams equal one process's."""
    path, _ = tiny
    prompts = [{"prompt_token_ids": [5 + i, 9, 30 + i, 7, 8]} for i in range(2)]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    expected = tiny_engines["roomy"].beam_search(prompts, params)
    llm = LLM(str(path), block_size=4, num_kv_blocks=256, tensor_parallel_size=2)
    try:
        got = llm.beam_search(prompts, params)
    finally:
        llm.close()
    for out, reference in zip(got, expected):  # the split sums differ in the last bits
        assert [s.tokens for s in out.sequences] == [s.tokens for s in reference.sequences]
        for seq, ref in zip(out.sequences, reference.sequences):
            assert seq.cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-4)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be in \\[1, 10\\]"),
        (dict(beam_width=11, max_tokens=4), "beam_width must be in \\[1, 10\\]"),
        (dict(beam_width=True, max_tokens=4), "beam_width must be an int"),
        (dict(beam_width=2.5, max_tokens=4), "beam_width must be an int"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be at least 1"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, length_penalty="1"), "length_penalty must be a number"),
        (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be True or False"),
    ],
)
def test_bad_beam_search_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_the_engine_refuses_what_it_cannot_run_before_any_work(tiny):
    path, _ = tiny
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_num_seqs=3)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="beam_width=4 is more than max_num_seqs=3"):
        llm.beam_search({"prompt_token_ids": [5]}, BeamSearchParams(4, 4))
    with pytest.raises(ValueError, match="params must be BeamSearchParams"):
        llm.beam_search({"prompt_token_ids": [5]}, {"beam_width": 2})
    # A bad prompt among good ones: nothing stays queued.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search(
            [{"prompt_token_ids": [5]}, {"prompt_token_ids": [999]}], BeamSearchParams(2, 4)
        )
    assert not engine.has_unfinished_requests() and not engine.request_groups["beam_search"].groups
    assert_every_block_free(llm)
    other = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, scheduling_policy="static"))
    with pytest.raises(ValueError, match="beam search needs the continuous"):
        other.add_beam_search_request("r", {"prompt_token_ids": [5]}, BeamSearchParams(2, 4))
    other.close()


def test_a_search_joining_overlapped_steps_waits_for_the_step_in_flight(tiny):
    """With async scheduling a step runs while the next is scheduled. A beam search that
    arrives then makes the engine finish the step in flight and stop overlapping until the
    search ends; the other requests' tokens and the beams equal a never-overlapping run."""
    path, _ = tiny
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for overlap in (True, False):
        llm = LLM(str(path), block_size=4, num_kv_blocks=256, async_scheduling=overlap)
        engine = llm.llm_engine
        engine.add_request("plain", {"prompt_token_ids": [5, 6, 7]}, greedy)
        outputs = {}
        for _ in range(3):
            outputs |= {o.request_id: o for o in engine.step()}
        assert (engine.in_flight is not None) == overlap  # a step is running behind
        engine.add_beam_search_request("beams", {"prompt_token_ids": [9, 8, 7, 6]}, params)
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step()}
            if engine.request_groups["beam_search"].groups:
                assert engine.in_flight is None  # no overlap while the search runs
        results[overlap] = [
            outputs["plain"].outputs[0].token_ids,
            [c.token_ids for c in outputs["beams"].outputs],
        ]
        assert_every_block_free(llm)
        llm.llm_engine.close()
    assert results[True] == results[False]
