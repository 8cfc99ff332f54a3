"""Penalties, ``logit_bias`` and ``allowed_token_ids``, as vLLM defines them.

The sampler against a float64 reference written from the definitions (exact token ids at
temperature 0, each row of a mixed batch as if alone); the engine against a reference
greedy loop over the Hugging Face model and against transformers' own
``generate(repetition_penalty=...)``; speculative decoding keeps outputs (penalized
requests get no drafts, biased ones are verified with the bias); bad values refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.sampler import Sampler, apply_penalties, apply_token_bias, sampling_probs
from minivllm.scheduler_output import ScheduledChunk
from minivllm.spec_decode.rejection_sampler import target_probs

VOCAB = 50


def reference_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, float64, token by token, straight from the definitions, in vLLM's order:
    allowed ids, logit bias, repetition penalty (prompt + output, transformers' rule),
    then frequency and presence penalties (output only, OpenAI's rule)."""
    logits = logits.double().clone()
    if params.allowed_token_ids:
        keep = set(params.allowed_token_ids)
        for token in range(len(logits)):
            if token not in keep:
                logits[token] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        if logits[token] > 0:
            logits[token] /= params.repetition_penalty
        else:
            logits[token] *= params.repetition_penalty
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token)
        logits[token] -= params.presence_penalty
    return logits


def _chunk(params: SamplingParams, prompt: list[int], output: list[int]) -> ScheduledChunk:
    return ScheduledChunk(
        "r", [0], 0, [], sample=True, sampling_params=params,
        num_output_tokens=len(output), prompt_token_ids=prompt, output_token_ids=output,
    )  # fmt: skip


token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=12)
row_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0, 10.0]),
    frequency_penalty=st.sampled_from([0.0, -2.0, -0.7, 0.4, 2.0]),
    presence_penalty=st.sampled_from([0.0, -2.0, -0.3, 1.1, 2.0]),
    logit_bias=st.none() | st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100)),
    allowed_token_ids=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
)


@given(
    rows=st.lists(st.tuples(row_params, token_lists, token_lists), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_greedy_batch_equals_the_float64_reference_row_by_row(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    chunks = [_chunk(p, prompt, output) for p, prompt, output in rows]
    got = Sampler()(logits, chunks)
    want = [
        int(reference_logits(logits[i], p, prompt, output).argmax())
        for i, (p, prompt, output) in enumerate(rows)
    ]
    assert got == want


@given(rows=st.lists(st.tuples(row_params, token_lists, token_lists), min_size=1, max_size=4))
def test_penalized_logits_match_the_reference_values(rows):
    logits = torch.randn(len(rows), VOCAB) * 4
    params = [p for p, _, _ in rows]
    got = apply_penalties(logits, params, [r[1] for r in rows], [r[2] for r in rows])
    for i, (p, prompt, output) in enumerate(rows):
        want = reference_logits(logits[i], SamplingParams(
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
        ), prompt, output)  # fmt: skip
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)


def test_neutral_rows_are_left_bit_for_bit():
    """A request without penalties shares a batch with one that has them: its row is the
    model's logits, exactly (so plain greedy and seeded outputs cannot change)."""
    logits = torch.randn(2, VOCAB)
    got = apply_penalties(
        logits,
        [SamplingParams(), SamplingParams(repetition_penalty=1.5)],
        [[1, 2, 3], [1, 2]],
        [[3, 3, 4], [3]],
    )
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])


# --- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)


PROMPTS = [[1, 17, 42, 99, 5, 17], [1, 3, 3, 3], [1, 200, 201, 202, 203, 204, 205]]


def _generate(llm, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _reference_greedy(hf_model, prompt: list[int], params: SamplingParams) -> list[int]:
    """A greedy loop over the HF model, the reference definitions on float64 logits."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_logits(logits, params, prompt, output).argmax()))
    return output


PENALIZED = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=-1.2, frequency_penalty=0.3),
    dict(logit_bias={7: 30.0, 8: -5.0}),
    dict(allowed_token_ids=[5, 9, 17, 42], repetition_penalty=1.4),
]


@pytest.mark.parametrize("options", PENALIZED)
def test_engine_greedy_equals_the_reference_loop(llm, hf_model, options):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **options)
    want = [_reference_greedy(hf_model, p, params) for p in PROMPTS]
    assert _generate(llm, PROMPTS, params) == want
    plain = _generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert plain != want  # the options change the output: the test can tell


def test_a_batch_mixing_penalties_equals_each_alone(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **options)
        for options in [{}, *PENALIZED]
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = [_generate(llm, [prompt], p)[0] for prompt, p in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in together] == alone


def test_logit_bias_minus_100_on_the_greedy_token_removes_it(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _generate(llm, [PROMPTS[0]], params)[0]
    banned = plain[0]
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={banned: -100})
    assert banned not in _generate(llm, [PROMPTS[0]], biased)[0]


def test_repetition_penalty_equals_transformers_generate_on_the_tiny_model(llm, hf_model):
    _check_against_hf_generate(llm, hf_model, [PROMPTS[0], PROMPTS[2]], 1.5, 16)


@pytest.mark.slow  # the real model, twice
def test_repetition_penalty_equals_transformers_generate_on_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [
        tokenizer("The capital of France is").input_ids,
        tokenizer("def fibonacci(n):").input_ids,
        tokenizer("Once upon a time, there was a little").input_ids,
    ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32)
    llm = LLM(model=str(smollm2_path), num_kv_blocks=64, block_size=16)
    _check_against_hf_generate(llm, hf, prompts, 1.5, 24)


def _check_against_hf_generate(llm, hf_model, prompts, penalty: float, max_tokens: int):
    """Greedy with ``repetition_penalty``: minivllm's tokens equal transformers'
    ``generate`` (which stops at EOS, as minivllm does without ``ignore_eos``)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=penalty)
    got = _generate(llm, prompts, params)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_tokens,
                repetition_penalty=penalty,
                pad_token_id=hf_model.config.eos_token_id,
            )
        assert tokens == out[0, len(prompt) :].tolist()
    plain = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert plain != got  # the penalty changed something: the comparison can fail


# --- speculative decoding ----------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
REPETITIVE = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize(
    "options, drafted",
    [
        (dict(repetition_penalty=1.3), False),  # depends on each draft's history: no drafts
        (dict(frequency_penalty=0.5), False),
        (dict(logit_bias={9: 2.0, 6: -3.0}), True),  # position-free: verified with the bias
        (dict(allowed_token_ids=[5, 6, 7, 9]), True),
    ],
)
def test_speculation_keeps_outputs(tiny_llama_path, llm, options, drafted):
    """Greedy: the same tokens with or without speculation. Seeded sampling: the same
    tokens too where there are no drafts (verification consumes random numbers
    differently, so with drafts only the distribution is the same; see below)."""
    spec = LLM(model=str(tiny_llama_path), num_kv_blocks=64, block_size=4,
               speculative_config=NGRAM)  # fmt: skip
    runs = [(0, None)] if drafted else [(0, None), (0.8, 7)]
    for temperature, seed in runs:
        params = SamplingParams(
            temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True, **options
        )
        assert _generate(spec, REPETITIVE, params) == _generate(llm, REPETITIVE, params)
    assert (spec.llm_engine.spec_decoding_stats.num_draft_tokens > 0) == drafted


def test_drafts_are_verified_against_the_biased_distribution():
    """The rejection sampler's target distribution for a biased request is the plain
    sampler's: allowed ids and bias first, then temperature and the filters."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(
        temperature=0.7, top_k=5, logit_bias={3: 4.0, 4: -50.0}, allowed_token_ids=[1, 3, 4, 8]
    )
    want = sampling_probs(apply_token_bias(logits, [params] * 3), [params] * 3)
    assert torch.equal(target_probs(logits, params), want)
    reference = reference_logits(logits[0], params, [], []) / params.temperature
    torch.testing.assert_close(target_probs(logits, params)[0].double(), reference.softmax(-1))


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"repetition_penalty": 0},
            r"repetition_penalty must be finite and >= 0.01 \(1 is none\), got 0",
        ),
        ({"repetition_penalty": 1e-39}, "repetition_penalty must be finite and >= 0.01"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty must be finite and >= 0.01"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2.0, 2.0\], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be in"),
        ({"logit_bias": {5: 101}}, r"logit_bias .* got 5: 101"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias must be an int"),
        ({"logit_bias": [1]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"presence_penalty": "high"}, "presence_penalty must be a number"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused(llm, field):
    value = {300: 1.0} if field == "logit_bias" else [1, 300]
    with pytest.raises(ValueError, match=rf"{field} has token ids \[300\] outside the vocab"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(**{field: value}))
    assert _generate(llm, [[1, 2]], SamplingParams(max_tokens=2))  # still serving


def test_the_smallest_repetition_penalty_keeps_the_top_token():
    """At the smallest allowed penalty, seen tokens' logits grow 100x but stay finite: the
    probabilities are a distribution and greedy picks the largest penalized logit (below
    it, a seen logit of 1 became +inf, ties gave NaN, and token 0 came out)."""
    from minivllm.sampling_params import MIN_REPETITION_PENALTY

    logits = torch.tensor([[0.5, 30.0, -4.0, 29.0, 1e30]], dtype=torch.float32)
    params = [SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY)]
    out = apply_penalties(logits, params, [[1, 3]], [[2]])
    assert torch.isfinite(out).all()
    assert out[0].tolist() == pytest.approx([0.5, 3000.0, -0.04, 2900.0, 1e30], rel=1e-6)
    assert int(out.argmax()) == 4
