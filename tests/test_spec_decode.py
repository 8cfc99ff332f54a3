"""Speculative decoding: n-gram drafts verified inside the continuous batch.

The proposer and the rejection sampler on their own, then the engine with tiny real
models: greedy outputs identical to plain decoding (under chunked prefill, preemption and
prefix caching, with stops firing inside accepted runs), seeded sampling with the same
distribution as plain sampling, and bad configurations refused. The stateful scheduler
machine (test_scheduler_invariants.py) runs speculative steps with random acceptance.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.attention import register_backend
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.cli import build_parser, main
from minivllm.config import SpeculativeConfig
from minivllm.spec_decode import NgramProposer, SpecDecodingStats
from minivllm.spec_decode.rejection_sampler import (
    RejectionSampler,
    accept_greedy,
    accept_random,
    target_probs,
)
from tests.helpers import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


# --- the n-gram proposer ---------------------------------------------------------------------


def test_proposer_docstring_example_from_vllm():
    # The 3-gram [4, 2, 3] never occurred before; the 2-gram [2, 3] did, at index 1.
    assert NgramProposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_proposer_prefers_the_longest_ngram_then_the_earliest_occurrence():
    proposer = NgramProposer(2, 1, 2)
    # [7, 8] occurs at index 0 (followed by 1, 2) and at index 4 (followed by 3, 4):
    # the earliest wins, as in vLLM.
    assert proposer.propose([7, 8, 1, 2, 7, 8, 3, 4, 7, 8]) == [1, 2]
    # The 2-gram [5, 8] has no earlier occurrence; the 1-gram [8] first occurs at 1.
    assert proposer.propose([9, 8, 6, 5, 8]) == [6, 5]


def test_proposer_clamps_and_gives_up():
    proposer = NgramProposer(5, 2, 3)
    assert proposer.propose([1, 2, 3, 1, 2], max_num_tokens=2) == [3, 1]
    assert proposer.propose([1, 2, 3, 1, 2], max_num_tokens=0) == []
    assert proposer.propose([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert proposer.propose([1, 2]) == []  # shorter than min_n + 1
    assert proposer.propose([4, 4, 4]) == [4]  # the match may overlap the suffix


def test_proposer_tries_the_longest_ngram_first():
    """[1 2] matches at index 2 (followed by 8 1); the shorter [2] matches earlier, at index
    0 (followed by 7 1): the 2-gram wins."""
    assert NgramProposer(2, 1, 2).propose([2, 7, 1, 2, 8, 1, 2]) == [8, 1]
    # From 3 down: [8 1 2] never occurred before, [1 2] did; [2] is not reached.
    assert NgramProposer(2, 1, 3).propose([2, 7, 1, 2, 8, 1, 2]) == [8, 1]


def test_proposer_lookup_longer_than_the_request_and_a_single_draft():
    # prompt_lookup_max 5 on three tokens: only the 2-gram and the 1-gram can be looked up.
    assert NgramProposer(2, 1, 5).propose([1, 2, 1]) == [2, 1]
    assert NgramProposer(3, 1, 2).propose([1, 2, 3, 1, 2], max_num_tokens=1) == [3]
    assert NgramProposer(1, 1, 2).propose([1, 2, 3, 1, 2]) == [3]
    assert NgramProposer(3, 2, 2).propose([1, 2, 3, 1, 2], max_num_tokens=None) == [3, 1, 2]
    # The longest n-gram of [4 4 4] is [4 4], at index 0: one token follows it.
    assert NgramProposer(2, 1, 5).propose([4, 4, 4]) == [4]
    # prompt_lookup_min 2: the 1-gram [2] (at index 1) is never looked up.
    assert NgramProposer(2, 2, 3).propose([1, 2, 3, 2]) == []
    assert NgramProposer(2, 1, 3).propose([1, 2, 3, 2]) == [3, 2]
    assert NgramProposer(2, 1, 3).propose([]) == [] and NgramProposer(2, 1, 3).propose([7]) == []


# --- the rejection sampler -------------------------------------------------------------------


def test_greedy_acceptance_keeps_the_matching_prefix_then_corrects():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert accept_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # 1 accepted + correction
    assert accept_greedy([5, 6, 7, 8], [1, 6, 7]) == [5]  # none accepted


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is the
    one-sided 0.1 % point of the standard normal (a false alarm 1 time in 1000)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness_of_fit(samples: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts, n = Counter(samples), len(samples)
    expected = (probs * n).tolist()
    stat = sum((counts.get(i, 0) - e) ** 2 / e for i, e in enumerate(expected) if e > 0)
    return stat, sum(e > 0 for e in expected) - 1


PROBS = torch.tensor([[0.45, 0.25, 0.15, 0.1, 0.05, 0.0], [0.1, 0.2, 0.3, 0.2, 0.1, 0.1],
                      [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])  # fmt: skip


def first_two_tokens(verify, drafts, num_samples=6000):
    generator = torch.Generator().manual_seed(1234)
    firsts, seconds = [], []
    for _ in range(num_samples):
        emitted = verify(PROBS, drafts, generator)
        firsts.append(emitted[0])
        if emitted[0] == drafts[0] and len(emitted) > 1:
            seconds.append(emitted[1])
    return firsts, seconds


@pytest.mark.parametrize("drafts", [[0, 2], [4, 1], [5, 0]])  # p(draft) = .45, .05, 0
def test_speculative_sampling_emits_exactly_the_target_distribution(drafts):
    """Over 6000 seeded verifications, the first emitted token follows p_0, and the second
    (given the first draft was accepted) follows p_1: chi-square at the 0.1 % level."""
    firsts, seconds = first_two_tokens(accept_random, drafts)
    stat, df = chi2_goodness_of_fit(firsts, PROBS[0])
    assert stat < chi2_critical(df), (stat, Counter(firsts))
    if len(seconds) > 500:
        stat, df = chi2_goodness_of_fit(seconds, PROBS[1])
        assert stat < chi2_critical(df), (stat, Counter(seconds))


def test_the_distribution_test_catches_a_wrong_recovery():
    """The same test fails a sampler that resamples from p itself (x not removed) after a
    rejection: the test has the power to see a biased verifier."""

    def wrong(probs, drafts, generator):
        if torch.rand((), generator=generator) < probs[0, drafts[0]]:
            return [drafts[0]]
        noise = torch.empty_like(probs[0]).exponential_(generator=generator)
        return [int((probs[0] / noise).argmax())]

    firsts, _ = first_two_tokens(wrong, [0, 2])
    stat, df = chi2_goodness_of_fit(firsts, PROBS[0])
    assert stat > chi2_critical(df)


LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.6])


@pytest.mark.parametrize(
    "options",
    [dict(temperature=0.5), dict(temperature=1.3, top_k=3), dict(temperature=0.8, top_p=0.7),
     dict(temperature=1.2, top_k=6, top_p=0.9), dict(temperature=0.7, top_k=1)],
)  # fmt: skip
def test_drafts_are_verified_against_the_plain_samplers_distribution(options):
    """The rejection sampler's target distribution is temperature, then top-k, then top-p:
    the textbook definitions of test_sampler_distribution.py, on every row."""
    from tests.test_sampler_distribution import reference_probs

    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = target_probs(rows, SamplingParams(**options))
    for row, logits in zip(probs, rows):
        expected = reference_probs(logits.double().numpy(), **options)
        assert torch.allclose(row.double(), torch.from_numpy(expected), atol=1e-6)


def test_the_rejection_sampler_verifies_greedy_drafts_against_the_argmax():
    logits = torch.full((4, 10), -1.0)
    logits[torch.arange(4), torch.tensor([5, 6, 7, 8])] = 3.0  # argmax per row: 5 6 7 8
    greedy = SamplingParams(temperature=0)
    assert RejectionSampler()(logits, [5, 6, 7], greedy, None) == [5, 6, 7, 8]
    assert RejectionSampler()(logits, [5, 9, 7], greedy, None) == [5, 6]


def test_greedy_verification_applies_the_requests_token_bias_to_every_row():
    """allowed_token_ids and logit_bias hold at every verified position, as when sampling
    one token at a time: the argmax is taken after them, row by row."""
    logits = torch.full((3, 10), -1.0)
    logits[torch.arange(3), torch.tensor([5, 6, 7])] = 3.0  # unbiased argmax: 5 6 7
    only_2_or_4 = SamplingParams(temperature=0, allowed_token_ids=[2, 4], logit_bias={4: 1.0})
    assert RejectionSampler()(logits, [4, 4], only_2_or_4, None) == [4, 4, 4]
    assert RejectionSampler()(logits, [5, 6], only_2_or_4, None) == [4]
    toward_9 = SamplingParams(temperature=0, logit_bias={9: 10.0})
    assert RejectionSampler()(logits, [9, 6], toward_9, None) == [9, 9]


def test_a_seeded_verification_is_reproducible():
    """Every random choice (accepting a draft, the recovered and the bonus token) comes from
    the request's own generator."""
    params = SamplingParams(temperature=1.0)

    def verify(seed):
        generator = torch.Generator().manual_seed(seed)
        return [RejectionSampler()(PROBS.log(), [0, 2], params, generator) for _ in range(50)]

    assert verify(7) == verify(7)
    assert verify(7) != verify(8)


def test_the_rejection_sampler_samples_from_the_filtered_distribution():
    """top_k 2 leaves tokens 0 and 1: a draft outside them is always rejected and the
    emitted token is always one of them; a draft of token 0 is accepted with the
    renormalised p = 0.6 / 0.9 = 2/3 (0.6 if top-k were ignored)."""
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_k=2)
    generator = torch.Generator().manual_seed(0)
    rejected = [RejectionSampler()(logits, [3], params, generator) for _ in range(200)]
    assert {len(e) for e in rejected} == {1} and {e[0] for e in rejected} == {0, 1}
    accepted = [RejectionSampler()(logits, [0], params, generator) for _ in range(2000)]
    num_accepted = sum(len(e) == 2 for e in accepted)
    assert 1270 < num_accepted < 1400  # 1333 expected, standard deviation 21; seeded
    assert {e[1] for e in accepted if len(e) == 2} == {0, 1}  # the bonus: top-k 2 too


def test_metrics_follow_vllms_definitions():
    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.observe_draft(3, 3)
    stats.observe_draft(3, 1)
    stats.observe_draft(2, 0)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert "Mean acceptance length: 2.33" in stats.log_line()


def test_metrics_before_any_draft_are_zero_not_a_division_error():
    stats = SpecDecodingStats(num_spec_tokens=2)
    assert stats.as_dict() == {
        "spec_decode_num_drafts": 0,
        "spec_decode_num_draft_tokens": 0,
        "spec_decode_num_accepted_tokens": 0,
        "spec_decode_num_accepted_tokens_per_pos": [0, 0],
        "spec_decode_acceptance_rate": 0.0,
        "spec_decode_mean_acceptance_length": 0.0,
        "spec_decode_acceptance_rate_per_pos": [0.0, 0.0],
    }
    # No draft: no "Mean acceptance length: 0.00" (no measurement shown as one) in the
    # printed line, and the server's periodic log has no line at all, as vLLM's.
    assert "Mean acceptance length" not in stats.log_line()
    assert "no drafts proposed yet" in stats.log_line()
    from minivllm.entrypoints.stats_logger import read_step
    from minivllm.stats import StepStats

    step = StepStats(0.0, 1.0, 8, 1, 0, 2, 1, 0, 4, 9, [], ["a"], [], [])
    step.spec_decoding = stats
    assert read_step(step).spec_decode_line is None
    stats.observe_draft(2, 1)
    assert read_step(step).spec_decode_line == stats.log_line()
    assert "Mean acceptance length: 2.00" in stats.log_line()  # 1 + 1 accepted / 1 draft


def test_metrics_since_a_snapshot_count_only_what_came_after():
    """As after a warm-up: the difference of two snapshots, counter by counter."""
    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.observe_draft(3, 2)
    warm = stats.copy()  # what the engine's per-step snapshot holds
    stats.observe_draft(3, 3)
    stats.observe_draft(1, 0)
    assert warm == SpecDecodingStats(3, 1, 3, 2, [1, 1, 0])  # untouched by later counting
    since = stats - warm
    assert since == SpecDecodingStats(3, num_drafts=2, num_draft_tokens=4,
                                      num_accepted_tokens=3,
                                      num_accepted_tokens_per_pos=[1, 1, 1])  # fmt: skip
    assert since.as_dict()["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 1]
    assert since.log_line() == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 3 tokens, "
        "Drafted: 4 tokens, Per-position acceptance rate: 0.500, 0.500, 0.500, "
        "Avg Draft acceptance rate: 75.0%"
    )


@pytest.mark.parametrize("drafted, accepted", [(2, 3), (4, 4), (1, -1)])
def test_metrics_refuse_an_impossible_observation(drafted, accepted):
    """More accepted than drafted, more drafts than k, or a negative count: a bug in the
    caller, caught where it happens."""
    with pytest.raises(AssertionError):
        SpecDecodingStats(num_spec_tokens=3).observe_draft(drafted, accepted)


# --- configuration ---------------------------------------------------------------------------


def test_config_defaults_like_vllm():
    assert (SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min,
            SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_max) == (5, 5)  # fmt: skip
    only_max = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    config = EngineConfig(speculative_config=NGRAM)
    assert config.speculative_config == SpeculativeConfig(**NGRAM)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive int, got 0"),
        ({}, "num_speculative_tokens must be a positive int, got None"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown speculative method 'eagle'"),
        ({"num_speculative_tokens": 2, "ngram_max": 3}, "unknown speculative_config key(s) "
         "'ngram_max'"),
        ("ngram", "speculative_config must be a dict, got 'ngram'"),
    ],
)  # fmt: skip
def test_bad_speculative_config_is_refused_naming_the_value(options, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=options)
    assert message in str(e.value)


def test_speculation_needs_the_continuous_policy():
    with pytest.raises(ValueError, match="continuous"):
        EngineConfig(speculative_config=NGRAM, scheduling_policy="static")


def test_cli_parses_and_refuses_speculative_config(tiny_llama_path, capsys):
    args = build_parser().parse_args(
        ["generate", "w1 w2", "--speculative-config", '{"num_speculative_tokens": 2}']
    )
    assert args.speculative_config == {"num_speculative_tokens": 2}
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "w1", "--speculative-config", "{bad"])
    assert e.value.code == 2
    bad = '{"num_speculative_tokens": -1}'
    argv = ["generate", "w1", "--model", str(tiny_llama_path), "--speculative-config", bad]
    assert main(argv) == 2
    assert "num_speculative_tokens must be a positive int, got -1" in capsys.readouterr().err


@register_backend
class SingleQueryDecodeBackend(TorchAttentionBackend):
    """A backend that declares it cannot run a decode as several query rows."""

    name = "test-single-query-decode"
    supports_multi_token_decode = False


def test_a_backend_without_multi_token_decode_is_refused(tiny_llama_path):
    with pytest.raises(ValueError, match="'test-single-query-decode' cannot take multi-token"):
        LLM(str(tiny_llama_path), attention_backend=SingleQueryDecodeBackend.name,
            speculative_config=NGRAM)  # fmt: skip


# --- the engine: greedy outputs identical to plain decoding ----------------------------------


@pytest.fixture(scope="module")
def bigram_llama_path(tmp_path_factory):
    """A tiny llama whose layers add nothing (attention and MLP outputs zeroed): its next
    token is a fixed function of the current one, so its output soon cycles and n-gram
    drafts of its own output are nearly always accepted. The random tiny model is the
    opposite (drafts nearly always rejected); the tests use both."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bigram"), "llama", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return path


# Prompts that repeat themselves, so the proposer finds matches from the first decode on.
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 10 + i)) * 2} for i in range(3)]


def run(path, prompts, params, **options):
    options = {"attention_backend": "torch", "block_size": 4} | options
    llm = LLM(str(path), **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outputs], llm.llm_engine.stats()


SCENARIOS = {
    "plain": {},
    "chunked prefill": {"max_num_batched_tokens": 10},
    "preemption": {"num_kv_blocks": 14, "max_num_seqs": 3},
    # Two requests at a time, and the first two prompts again at the end: they hit.
    "prefix caching": {"enable_prefix_caching": True, "max_num_seqs": 2},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_outputs_are_identical_with_and_without_speculation(
    scenario, tiny_llama_path, bigram_llama_path
):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = SCENARIOS[scenario]
    num_accepted = num_rejected = 0
    prompts = PROMPTS + PROMPTS[:2] if scenario == "prefix caching" else PROMPTS
    for path in (tiny_llama_path, bigram_llama_path):
        plain, _ = run(path, prompts, params, **options)
        spec, stats = run(path, prompts, params, speculative_config=NGRAM, **options)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        num_accepted += stats["spec_decode_num_accepted_tokens"]
        num_rejected += (
            stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"]
        )
        if scenario == "preemption":
            assert stats["num_preemptions_total"] > 0
        if scenario == "prefix caching":
            assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]  # nothing leaked
    assert num_accepted > 20 and num_rejected > 20  # the runs really verified drafts


def test_every_tiny_architecture_verifies_drafts_correctly(tiny_model_path):
    """Multi-token decode queries through each architecture (GQA, biases, qk-norm). Each
    prompt is followed by the model's own continuation, so the proposer finds drafts."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first, _ = run(tiny_model_path, PROMPTS[:2], params)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] + o.token_ids}
               for p, o in zip(PROMPTS, first)]  # fmt: skip
    plain, _ = run(tiny_model_path, prompts, params)
    spec, stats = run(tiny_model_path, prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_draft_tokens"] > 0


def test_numba_cpu_backend_takes_multi_token_decode_queries(tiny_llama_path):
    """A decode with drafts is a chunk of 1 + d query rows; with the numba kernel too the
    outputs equal plain decoding's (the tests above use the torch reference)."""
    pytest.importorskip("numba")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = {"attention_backend": "numba-cpu", "block_size": 2}  # drafts cross block edges
    first, _ = run(tiny_llama_path, PROMPTS[:2], params, **options)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] + o.token_ids}
               for p, o in zip(PROMPTS, first)]  # fmt: skip
    plain, _ = run(tiny_llama_path, prompts, params, **options)
    spec, stats = run(tiny_llama_path, prompts, params, speculative_config=NGRAM, **options)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_draft_tokens"] > 0


def stop_cases(greedy_output: list[int], prompt_len: int):
    """Stops that fire inside a run of accepted drafts: a stop token id and a stop string
    at output token 9 (a token not produced before), max_tokens, max_model_len."""
    stop_token = greedy_output[9]
    assert stop_token not in greedy_output[:9]
    word = f"w{stop_token - 3}"  # the tiny tokenizer's word for that id
    return {
        "stop token id": (
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
            {},
        ),
        "stop string": (SamplingParams(temperature=0, max_tokens=40, stop=[word]), {}),
        "max_tokens": (SamplingParams(temperature=0, max_tokens=11, ignore_eos=True), {}),
        "max_model_len": (
            SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
            {"max_model_len": prompt_len + 10},
        ),
    }


@pytest.mark.parametrize("case", ["stop token id", "stop string", "max_tokens", "max_model_len"])
def test_stops_inside_an_accepted_run_end_the_output_exactly(case, bigram_llama_path):
    """The prompt already holds the cycle the bigram model settles in, so drafts are
    accepted from the first decode on (4 tokens per step with k = 3), and each stop fires
    in the middle of an accepted run: the tokens after it are dropped."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [warm], _ = run(bigram_llama_path, [PROMPTS[0]], greedy)
    prompt_ids = PROMPTS[0]["prompt_token_ids"] + warm.token_ids[:30]
    prompt = {"prompt_token_ids": prompt_ids}
    [reference], _ = run(bigram_llama_path, [prompt], greedy)
    params, options = stop_cases(reference.token_ids, len(prompt_ids))[case]
    [plain], _ = run(bigram_llama_path, [prompt], params, **options)
    [spec], stats = run(bigram_llama_path, [prompt], params, speculative_config=NGRAM, **options)
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == (
        plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason
    )  # fmt: skip
    assert len(plain.token_ids) in (9, 10, 11)  # stopped at output token 9, 10 or 11
    assert stats["spec_decode_mean_acceptance_length"] > 3


# --- the engine: sampling ---------------------------------------------------------------------


def chi2_homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories seen at least 10 times in all;
    the rest are pooled into one."""
    ca, cb = Counter(a), Counter(b)
    total = ca + cb
    frequent = [k for k, n in total.items() if n >= 10]
    rows = [(ca[k], cb[k]) for k in frequent]
    rows.append((len(a) - sum(r[0] for r in rows), len(b) - sum(r[1] for r in rows)))
    rows = [r for r in rows if sum(r)]
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        n = x + y
        for observed, size in ((x, na), (y, nb)):
            expected = n * size / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


@pytest.mark.slow
def test_seeded_sampling_matches_plain_sampling_in_distribution(bigram_llama_path):
    """300 seeded requests with and without drafts (temperature 1, top-k 20, top-p 0.95):
    the 2nd and 3rd output tokens (the 1st is sampled after the prefill, without drafts)
    pass a two-sample chi-square test at the 0.1 % level, position by position. The
    prompt holds the model's own greedy cycle, so drafts exist and are accepted or
    rejected. Seeds are fixed, so the test is deterministic, and reproducible."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [warm], _ = run(bigram_llama_path, [PROMPTS[0]], greedy)
    prompt = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + warm.token_ids}
    num_samples = 300
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=3,
                             ignore_eos=True, seed=s) for s in range(num_samples)]  # fmt: skip
    options = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}
    plain, _ = run(bigram_llama_path, [prompt] * num_samples, params, **options)
    spec, stats = run(bigram_llama_path, [prompt] * num_samples, params,
                      speculative_config=NGRAM, **options)  # fmt: skip
    for position in (1, 2):
        stat, df = chi2_homogeneity(
            [o.token_ids[position] for o in plain], [o.token_ids[position] for o in spec]
        )
        assert stat < chi2_critical(df), (position, stat, df)
    accepted = stats["spec_decode_num_accepted_tokens"]
    assert 10 < accepted < stats["spec_decode_num_draft_tokens"] - 10

    # Reproducible: the same seeds in the same batch give the same tokens. (Not across
    # batches: how many drafts a request gets depends on the budget its batch leaves.)
    first, _ = run(bigram_llama_path, [prompt] * 40, params[:40], speculative_config=NGRAM,
                   **options)  # fmt: skip
    again, _ = run(bigram_llama_path, [prompt] * 40, params[:40], speculative_config=NGRAM,
                   **options)  # fmt: skip
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_outputs_are_identical_and_copying_pays(smollm2_path):
    """SmolLM2 asked to repeat a passage: identical greedy tokens, most drafts accepted."""
    passage = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. All that glitters is not gold."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    spec_llm = LLM(smollm2_path, speculative_config={"method": "ngram",
                   "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 2})  # fmt: skip
    spec = spec_llm.chat([messages, [{"role": "user", "content": "Count from 1 to 10."}]],
                         params, use_tqdm=False)  # fmt: skip
    plain = LLM(smollm2_path).chat(
        [messages, [{"role": "user", "content": "Count from 1 to 10."}]], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = spec_llm.llm_engine.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.3  # 0.37 measured
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]


# --- the server ------------------------------------------------------------------------------


def test_server_metrics_export_the_spec_decode_counters(bigram_llama_path):
    """``/metrics`` carries vLLM's four spec-decode counters, equal to the engine's."""
    pytest.importorskip("prometheus_client")
    import httpx

    from minivllm import LLMEngine
    from minivllm.entrypoints.openai.api_server import BackgroundServer
    from tests.test_server import _metric

    config = EngineConfig(model=str(bigram_llama_path), attention_backend="torch",
                          block_size=4, num_kv_blocks=64, speculative_config=NGRAM)  # fmt: skip
    engine = LLMEngine(config)
    words = " ".join(f"w{t - 3}" for t in PROMPTS[0]["prompt_token_ids"])
    with BackgroundServer(engine, model_name="tiny") as server:
        body = {"model": "tiny", "prompt": words, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        text = httpx.get(server.url + "/metrics").text
    stats = engine.spec_decoding_stats
    assert stats.num_drafts > 0
    assert _metric(text, "vllm:spec_decode_num_drafts_total") == stats.num_drafts
    assert _metric(text, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == stats.num_accepted_tokens
    for position, n in enumerate(stats.num_accepted_tokens_per_pos):
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert _metric(text, name, position=str(position)) == n
