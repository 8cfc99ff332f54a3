"""Sampling: filters, seeds that ignore batch companions, and every way to stop."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.sampler import _apply_top_k, _apply_top_p


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), num_kv_blocks=128, block_size=4)


def _ids(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPT = [1, 17, 42, 99, 5]
OTHERS = [[1] + list(range(3, 3 + n)) for n in (2, 9, 30, 4)]


def test_seeded_sample_ignores_batch_companions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _ids(llm, [PROMPT], params)[0]
    companion_params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    together = _ids(
        llm,
        [*OTHERS[:2], PROMPT, *OTHERS[2:]],
        [companion_params] * 2 + [params] + [companion_params] * 2,
    )[2]
    assert alone == together
    other_seed = _ids(
        llm,
        [PROMPT],
        SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True),
    )[0]
    assert other_seed != alone  # the seed matters (16 draws from a wide distribution)


def test_greedy_ignores_batch_companions(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _ids(llm, [PROMPT], params)[0]
    assert _ids(llm, [*OTHERS, PROMPT], params)[-1] == alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=1, seed=0),
        SamplingParams(temperature=1.5, min_p=1.0, seed=0),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=0),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=0),  # 0.0 in float32
        SamplingParams(temperature=1.0, top_p=5e-324, min_p=1.0, top_k=1, seed=0),
    ],
    ids=["top_k=1", "min_p=1", "tiny top_p", "top_p under float32", "all at once"],
)
def test_filters_that_leave_one_token_equal_greedy(llm, params):
    params.max_tokens, params.ignore_eos = 12, True
    greedy = _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert _ids(llm, [PROMPT], params) == greedy


@given(st.integers(1, 50), st.integers(0, 2**31))
def test_top_k_keeps_exactly_k(k, seed):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))
    kept = _apply_top_k(logits, [k, 0, 50]).isfinite().sum(-1).tolist()
    assert kept == [k, 50, 50]


@given(st.floats(0.01, 1.0), st.integers(0, 2**31))
def test_top_p_keeps_smallest_set_reaching_p(p, seed):
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(seed)) * 3
    kept = _apply_top_p(logits, [p]).isfinite()[0]
    probs = logits.softmax(-1)[0]
    kept_mass = probs[kept].sum().item()
    assert kept_mass >= p - 1e-5  # enough mass...
    smallest_kept = probs[kept].min().item()
    assert kept_mass - smallest_kept < p + 1e-5  # ...and nothing superfluous
    assert (probs[~kept] <= smallest_kept + 1e-7).all()  # the most likely tokens


extreme_floats = st.sampled_from([5e-324, 1e-300, 1e-45, 1e-30, 1e-7, 0.5, 1 - 1e-9, 1.0])


@given(
    top_p=extreme_floats,
    min_p=st.just(0.0) | extreme_floats,
    top_k=st.sampled_from([0, 1, 2, 49, 50, 51, 10**30]),
    temperature=st.sampled_from([1e-5, 1e-3, 0.7, 1.0, 50.0, 1e30, 1e300]),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**31),
)
def test_filters_at_extremes_always_keep_the_most_likely_token(
    top_p, min_p, top_k, temperature, scale, seed
):
    """Whatever the filters' parameters, the distribution is finite and keeps a most likely
    token: the sampler never draws from an empty set (which gave token 0). (min-p zeroes
    probabilities after the softmax without renormalising: the exponential race does not
    need it.)"""
    from minivllm.sampler import sampling_probs

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 50, generator=generator) * scale
    logits[1, 7] = float("-inf")  # a banned token (min_tokens, allowed_token_ids)
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    probs = sampling_probs(logits, [params, params])
    assert probs.isfinite().all() and (probs >= 0).all()
    if min_p == 0:
        assert torch.allclose(probs.sum(-1), torch.ones(2), atol=1e-5)
    # "Most likely" as float32 sees it: at temperature 1e30 every token is equally likely.
    unfiltered = (logits / min(temperature, torch.finfo(torch.float32).max)).softmax(-1)
    for row in range(2):
        kept, best = probs[row] > 0, unfiltered[row].max()
        assert unfiltered[row][kept].max() == best  # a most likely token is kept
        if top_k == 1 or min_p == 1.0 or top_p < 1e-30:  # only the most likely may be drawn
            assert (unfiltered[row][kept] == best).all()


def test_a_greedy_row_is_the_plain_softmax_and_leaves_its_neighbour_alone():
    """`sampling_probs` on a batch that mixes a greedy row with a sampled one: the greedy
    row is a distribution at temperature 1 (its caller takes the argmax), never a division
    by its temperature 0; the other row is as if alone."""
    from minivllm.sampler import sampling_probs

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=0.5)
    probs = sampling_probs(logits, [greedy, hot])
    torch.testing.assert_close(probs[0], logits[0].softmax(-1))
    torch.testing.assert_close(probs[1], sampling_probs(logits[1:], [hot])[0])


def test_sampler_follows_the_distribution():
    """The exponential race draws index i with probability probs[i]."""
    from minivllm.sampler import Sampler
    from minivllm.sequence import Sequence

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seq = Sequence(
        "r", [1], SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0)
    )
    sampler = Sampler()
    draws = torch.tensor([sampler(probs.log()[None], [seq])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4) / len(draws)
    assert torch.allclose(freq, probs, atol=0.03), freq


# --- stopping ---------------------------------------------------------------------------


def test_max_tokens_and_length_reason(llm):
    [out] = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    greedy = _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = greedy[4]
    first = greedy.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == greedy[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)


def test_stop_string_truncates_text(llm):
    tokenizer = llm.get_tokenizer()
    greedy = _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    full_text = tokenizer.decode(greedy)
    stop = tokenizer.decode(greedy[3:5])  # two words, spanning two tokens
    cut = full_text.index(stop)
    for include, expected_text in ((False, full_text[:cut]), (True, full_text[: cut + len(stop)])):
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        assert out.outputs[0].text == expected_text
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_eos_stops_unless_ignored(llm):
    """Make EOS the greedy choice by declaring the model's favourite token the EOS."""
    greedy = _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    engine = llm.llm_engine
    saved = engine.output_processor.eos_token_ids
    engine.output_processor.eos_token_ids = frozenset({greedy[2]})
    try:
        first = greedy.index(greedy[2])
        stopped = _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
        assert stopped == greedy[: first + 1]
        params = SamplingParams(
            temperature=0, max_tokens=12, min_tokens=first + 2, ignore_eos=False
        )
        assert len(_ids(llm, [PROMPT], params)[0]) >= first + 2  # min_tokens holds EOS back
        assert (
            _ids(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
            == greedy
        )
    finally:
        engine.output_processor.eos_token_ids = saved
