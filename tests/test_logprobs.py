"""Logprobs as vLLM returns them: the sampled token's log-probability and the top ones,
each with its rank and text; and the prompt's (``prompt_logprobs``, first position None).
All from the raw logits: they must equal ``log_softmax`` of transformers' logits."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.logprobs import compute_logprobs
from minivllm.outputs import Logprob
from minivllm.sampling_params import RequestOutputKind
from tests.helpers import TINY_VOCAB

PROMPT_IDS = list(range(3, 3 + 21))  # 21 tokens: chunks of 8 cut it mid-block
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]``: row i is the distribution of the token after i."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def assert_matches(row: dict[int, Logprob], token: int, expected: torch.Tensor, k: int):
    """``row`` holds ``token`` first, then the top ``k``, as ``expected`` ranks them."""
    assert next(iter(row)) == token
    order = expected.argsort(descending=True).tolist()
    assert list(row)[1:] == [t for t in order[:k] if t != token]
    for t, logprob in row.items():
        assert logprob.logprob == pytest.approx(float(expected[t]), abs=1e-4)
        assert logprob.rank == int((expected > expected[t]).sum()) + 1
        assert logprob.decoded_token == TINY_VOCAB[t]


@pytest.mark.parametrize("k", [0, 1, 5])
def test_sample_and_prompt_logprobs_equal_transformers_log_softmax(llm, hf_model, k):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=k, prompt_logprobs=k)
    [out] = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    expected = hf_log_softmax(hf_model, PROMPT_IDS + tokens)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(tokens) == 6
    for i, (token, row) in enumerate(zip(tokens, logprobs)):
        assert_matches(row, token, expected[len(PROMPT_IDS) - 1 + i], k)
        assert row[token].rank == 1  # greedy picks the most likely
    prompt_logprobs = out.prompt_logprobs
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        assert_matches(prompt_logprobs[i], PROMPT_IDS[i], expected[i - 1], k)


def test_logprobs_are_raw_before_temperature_and_penalties(llm, hf_model):
    params = SamplingParams(
        temperature=2.0, seed=7, max_tokens=4, logprobs=3, repetition_penalty=1.5,
        logit_bias={10: 50.0},
    )  # fmt: skip
    [out] = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokens[0] == 10  # the bias decides ...
    expected = hf_log_softmax(hf_model, PROMPT_IDS + tokens)
    for i, (token, row) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert_matches(row, token, expected[len(PROMPT_IDS) - 1 + i], 3)  # ... not the logprobs


def test_no_logprobs_asked_none_returned_and_tokens_unchanged(llm):
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
    asking = SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2, prompt_logprobs=1)
    [a] = llm.generate({"prompt_token_ids": PROMPT_IDS}, plain, use_tqdm=False)
    [b] = llm.generate({"prompt_token_ids": PROMPT_IDS}, asking, use_tqdm=False)
    assert a.outputs[0].logprobs is None and a.prompt_logprobs is None
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_out_of_range_logprobs_are_refused(name, bad):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: bad})


def test_prompt_logprobs_skip_the_prefix_cache(tiny_llama_path, hf_model):
    llm = LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64,
              enable_prefix_caching=True)  # fmt: skip
    prompt = {"prompt_token_ids": PROMPT_IDS}
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # caches 2 blocks
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert out.num_cached_tokens == 0
    expected = hf_log_softmax(hf_model, PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        assert_matches(out.prompt_logprobs[i], PROMPT_IDS[i], expected[i - 1], 0)


def test_chunked_prefill_and_delta_streaming_give_the_same_logprobs(tiny_llama_path, llm):
    params = dict(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=2)
    [whole] = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(**params),
                           use_tqdm=False)  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), block_size=BLOCK_SIZE,
                                    num_kv_blocks=64, max_num_batched_tokens=8))  # fmt: skip
    delta = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", {"prompt_token_ids": PROMPT_IDS}, delta)
    logprobs, prompt_logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
            logprobs += out.outputs[0].logprobs
            prompt_logprobs.append(out.prompt_logprobs)
    assert prompt_logprobs[0] is not None and prompt_logprobs[1:] == [None] * 4
    assert _values(prompt_logprobs[0]) == _values(whole.prompt_logprobs)
    assert _values(logprobs) == _values(whole.outputs[0].logprobs)


def _values(rows):
    """Rows as plain tuples, compared to 1e-5 (a chunked prefill sums in another order)."""
    return [
        None if row is None else {t: (round(p.logprob, 4), p.rank) for t, p in row.items()}
        for row in rows
    ]


def test_speculative_decoding_drafts_nothing_for_a_request_asking_for_logprobs(
    tiny_llama_path, hf_model
):
    llm = LLM(str(tiny_llama_path), block_size=BLOCK_SIZE, num_kv_blocks=64,
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1})  # fmt: skip
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]}  # ngrams to draft from
    stats = llm.llm_engine.spec_decoding_stats
    common = dict(temperature=0, max_tokens=6, allowed_token_ids=[5, 6, 7])  # seen tokens
    llm.generate(prompt, SamplingParams(**common), use_tqdm=False)
    assert stats.num_draft_tokens > 0  # without logprobs, this prompt gets drafts
    num_drafts = stats.num_draft_tokens
    [out] = llm.generate(prompt, SamplingParams(**common, logprobs=1), use_tqdm=False)
    assert stats.num_draft_tokens == num_drafts
    tokens = out.outputs[0].token_ids
    expected = hf_log_softmax(hf_model, prompt["prompt_token_ids"] + tokens)
    for i, (token, row) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        assert_matches(row, token, expected[len(prompt["prompt_token_ids"]) - 1 + i], 1)


def test_n_children_each_get_their_own_logprobs(llm, hf_model):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4, logprobs=1,
                            prompt_logprobs=0)  # fmt: skip
    [out] = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(PROMPT_IDS)
    for choice in out.outputs:
        expected = hf_log_softmax(hf_model, PROMPT_IDS + choice.token_ids)
        for i, (token, row) in enumerate(zip(choice.token_ids, choice.logprobs)):
            assert_matches(row, token, expected[len(PROMPT_IDS) - 1 + i], 1)


@pytest.mark.slow
def test_smollm2_logprobs_equal_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2_path), dtype="float32")
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5)
    [out] = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32)
    tokens = out.outputs[0].token_ids
    expected = hf_log_softmax(hf, prompt_ids + tokens)
    rows = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    for i, (token, row) in enumerate(zip(prompt_ids[1:] + tokens, rows)):
        assert next(iter(row)) == token
        for t, logprob in row.items():
            assert logprob.logprob == pytest.approx(float(expected[i, t]), abs=1e-4)
            assert logprob.rank == int((expected[i] > expected[i, t]).sum()) + 1
            assert logprob.decoded_token == tokenizer.convert_tokens_to_string(
                [tokenizer.convert_ids_to_tokens(t)]
            )


# compute_logprobs itself, on hand-made logits (no model): these are the tests the mutation
# run reaches (it leaves out those that load a checkpoint).


def test_compute_logprobs_gives_the_chosen_token_then_each_rows_own_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 10) * 3
    expected = logits.log_softmax(dim=-1)
    order = expected.argsort(dim=-1, descending=True).tolist()
    chosen = [order[0][4], order[1][0], order[2][9]]  # a middle, the best, the worst token
    rows = compute_logprobs(logits, chosen, [0, 3, 10])
    assert len(rows) == 3
    assert list(rows[0]) == [chosen[0]]  # no top tokens asked for row 0
    assert rows[0][chosen[0]] == Logprob(float(expected[0, chosen[0]]), 5)
    # Row 1 chose the best token: it is also top 1, listed once.
    assert list(rows[1]) == order[1][:3]
    # Row 2 chose the worst: first, then all ten in rank order (itself not again).
    assert list(rows[2]) == [chosen[2]] + order[2][:9]
    for i, row in enumerate(rows):
        for token, logprob in row.items():
            assert logprob.logprob == float(expected[i, token])  # exactly log_softmax
            assert logprob.rank == order[i].index(token) + 1


def test_compute_logprobs_rank_counts_only_strictly_more_likely_tokens():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    rows = compute_logprobs(logits, [0, 3], [2, 0])
    assert rows[0][0].rank == 3  # two tokens are more likely, none ties with it
    assert [rows[0][t].rank for t in list(rows[0])[1:]] == [1, 2]  # top list: rank by place
    assert rows[1][3].rank == 1  # all equal: none is strictly more likely
    assert rows[1][3].logprob == pytest.approx(-1.3862944)  # log(1/4)


def test_compute_logprobs_is_computed_in_float32_from_half_precision_logits():
    torch.manual_seed(1)
    logits = (torch.randn(2, 50) * 4).to(torch.bfloat16)
    expected = logits.float().log_softmax(dim=-1)
    rows = compute_logprobs(logits, [7, 8], [1, 1])
    for i, token in enumerate([7, 8]):
        assert rows[i][token].logprob == float(expected[i, token])
        [(top, top_logprob)] = [(t, lp) for t, lp in rows[i].items() if t != token] or [
            (token, rows[i][token])
        ]
        assert top_logprob.logprob == float(expected[i].max())
        assert top == int(expected[i].argmax()) and top_logprob.rank == 1


def test_detokenize_false_gives_the_same_tokens_and_logprobs_without_text(llm):
    kwargs = dict(temperature=0.8, seed=5, max_tokens=8, logprobs=3, prompt_logprobs=2)
    [text] = llm.generate(
        {"prompt_token_ids": PROMPT_IDS}, SamplingParams(**kwargs), use_tqdm=False
    )
    [ids] = llm.generate(
        {"prompt_token_ids": PROMPT_IDS}, SamplingParams(**kwargs, detokenize=False), use_tqdm=False
    )
    assert text.outputs[0].text and ids.outputs[0].text == ""
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert _values(ids.outputs[0].logprobs) == _values(text.outputs[0].logprobs)
    assert _values(ids.prompt_logprobs[1:]) == _values(text.prompt_logprobs[1:])
    rows = ids.outputs[0].logprobs + ids.prompt_logprobs[1:]
    assert all(lp.decoded_token is None for row in rows for lp in row.values())
    assert all(
        lp.decoded_token is not None for row in text.outputs[0].logprobs for lp in row.values()
    )
