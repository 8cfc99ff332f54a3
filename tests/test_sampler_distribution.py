"""The sampler draws from the distribution its parameters describe, checked by chi-square.

Each case draws many tokens from one row of logits with `Sampler` and compares the counts
with the probabilities an independent reference computes: the textbook definitions of
temperature, top-k, top-p and min-p, written here in float64 numpy (the sampler uses
torch). Every case leaves several tokens with different probabilities, so a filter that
keeps one token too many or too few, or a temperature that is ignored, changes the counts.

The verdict is a chi-square goodness-of-fit test: it fails when the p-value is below
``P_VALUE_THRESHOLD`` (1e-6), so a correct sampler would fail about once in a million
seeds; the seeds are fixed, so CI is deterministic. ``NUM_DRAWS`` is chosen so that the
test has power: `test_the_check_rejects_a_slightly_wrong_temperature` feeds the sampler a
temperature of 0.91 where the reference says 1 and requires the check to fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.sampler import Sampler, _apply_top_p
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

NUM_DRAWS = 30_000
P_VALUE_THRESHOLD = 1e-6
# Distinct, well separated logits: no ties at any filter's boundary.
LOGITS = np.array([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.6])


# --- the reference: the definitions, in float64 numpy -----------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Temperature, then top-k, then top-p, then min-p (the order the sampler documents)."""
    x = logits / temperature
    order = np.argsort(-x)  # most likely first
    if top_k:
        x = x.copy()
        x[order[top_k:]] = -np.inf
    if top_p < 1:
        probs = softmax(x)
        mass_before = np.cumsum(probs[order]) - probs[order]
        x = x.copy()
        x[order[mass_before >= top_p]] = -np.inf  # a token is kept while the mass before it < p
    probs = softmax(x)
    if min_p:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


# --- drawing and judging -------------------------------------------------------------------


def draw(logits: np.ndarray, params: SamplingParams, seed: int = 0) -> np.ndarray:
    """Token counts of ``NUM_DRAWS`` draws: one batch with the same row ``NUM_DRAWS`` times."""
    seq = Sequence("r", [1], params, generator=torch.Generator().manual_seed(seed))
    seqs = [seq] * NUM_DRAWS  # the sampler reads only its parameters and its generator
    rows = torch.tensor(logits, dtype=torch.float32).expand(NUM_DRAWS, -1)
    tokens = Sampler()(rows, seqs)
    return np.bincount(tokens, minlength=len(logits))


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's goodness of fit over the tokens the reference allows; a draw of a token
    the reference forbids is an outright failure (p = 0)."""
    allowed = probs > 0
    if counts[~allowed].any():
        return 0.0
    expected = probs[allowed] * counts.sum()
    statistic = float(((counts[allowed] - expected) ** 2 / expected).sum())
    dof = int(allowed.sum()) - 1
    # The chi-square survival function: the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


CASES = {
    # name: (sampler parameters, how many tokens the reference keeps)
    "temperature 1": (dict(temperature=1.0), 8),
    "temperature 0.5": (dict(temperature=0.5), 8),
    "temperature 1.7": (dict(temperature=1.7), 8),
    "top_k 4": (dict(temperature=1.0, top_k=4), 4),
    "top_k 3 at temperature 0.8": (dict(temperature=0.8, top_k=3), 3),
    "top_p 0.8": (dict(temperature=1.0, top_p=0.8), 4),
    "top_p 0.6 at temperature 1.3": (dict(temperature=1.3, top_p=0.6), 3),
    "min_p 0.15": (dict(temperature=1.0, min_p=0.15), 5),
    "min_p 0.25 at temperature 0.7": (dict(temperature=0.7, min_p=0.25), 3),
    "top_k 6, top_p 0.9, min_p 0.1": (dict(temperature=1.2, top_k=6, top_p=0.9, min_p=0.1), 5),
}


@pytest.mark.parametrize("name", CASES)
def test_sampler_matches_the_reference_distribution(name):
    options, num_kept = CASES[name]
    probs = reference_probs(LOGITS, **options)
    assert (probs > 0).sum() == num_kept, "the case should leave this many tokens"
    counts = draw(LOGITS, SamplingParams(**options))
    p_value = chi_square_p_value(counts, probs)
    assert p_value >= P_VALUE_THRESHOLD, (name, counts / NUM_DRAWS, probs)


@pytest.mark.parametrize("name", ["top_k 4", "top_p 0.8", "min_p 0.15"])
def test_each_filter_changes_the_distribution(name):
    """The reference itself: each filter case differs from plain temperature sampling, so
    a sampler that ignored the filter would fail the test above."""
    options, _ = CASES[name]
    unfiltered = {"temperature": options["temperature"]}
    counts = draw(LOGITS, SamplingParams(**unfiltered))
    assert chi_square_p_value(counts, reference_probs(LOGITS, **options)) < P_VALUE_THRESHOLD


def test_the_check_rejects_a_slightly_wrong_temperature():
    """The check's power: a sampler that used temperature 0.91 instead of 1 fails it."""
    probs = reference_probs(LOGITS, temperature=1.0)
    counts = draw(LOGITS / 0.91, SamplingParams(temperature=1.0))
    assert chi_square_p_value(counts, probs) < P_VALUE_THRESHOLD


def test_every_row_uses_its_own_parameters():
    """One batch, rows with different settings: each row follows its own distribution."""
    settings = [CASES["temperature 0.5"][0], CASES["top_k 4"][0], CASES["min_p 0.15"][0]]
    per_row = NUM_DRAWS // 3
    generator = torch.Generator().manual_seed(1)
    batch = [Sequence(f"r{j}", [1], SamplingParams(**o), generator=generator)
             for j, o in enumerate(settings)]  # fmt: skip
    rows = torch.tensor(LOGITS, dtype=torch.float32).expand(per_row * len(batch), -1)
    tokens = np.array(Sampler()(rows, batch * per_row))
    for j, options in enumerate(settings):
        counts = np.bincount(tokens[j :: len(settings)], minlength=len(LOGITS))
        assert chi_square_p_value(counts, reference_probs(LOGITS, **options)) >= 1e-6, options


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    """A temperature-0 row in a sampling batch takes the argmax, every time."""
    generator = torch.Generator().manual_seed(2)
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0)
    seqs = [Sequence(f"r{i}", [1], greedy if i % 2 else sampled, generator=generator)
            for i in range(200)]  # fmt: skip
    logits = torch.tensor(LOGITS[::-1].copy(), dtype=torch.float32).expand(200, -1)
    tokens = Sampler()(logits, seqs)
    assert set(tokens[1::2]) == {len(LOGITS) - 1}
    assert len(set(tokens[0::2])) > 1


def test_a_seeded_generator_repeats_its_draws():
    params = SamplingParams(temperature=1.0)
    assert (draw(LOGITS, params, seed=5) == draw(LOGITS, params, seed=5)).all()
    assert (draw(LOGITS, params, seed=5) != draw(LOGITS, params, seed=6)).any()


@pytest.mark.parametrize(
    "options",
    [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6), dict(top_p=0.25)],
    ids=["top_k=1", "min_p=1", "tiny top_p", "top_p below the top token"],
)
def test_filters_that_leave_one_token_always_draw_the_argmax(options):
    """The edge of each filter: the most likely token itself is always kept. (The most
    likely token is the last one here, so that a sampler that masked every token and
    then drew index 0 would fail.)"""
    counts = draw(LOGITS[::-1].copy(), SamplingParams(temperature=1.5, **options))
    assert counts[-1] == NUM_DRAWS, counts


def test_top_p_stops_as_soon_as_the_kept_mass_reaches_p():
    """Probabilities that are exact in binary, so "reaches p" is an exact equality: with
    p = 0.5 the top token alone (0.5) is enough; with p = 0.75 the first two."""
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert _apply_top_p(logits, [0.5]).isfinite().tolist() == [[True, False, False, False]]
    assert _apply_top_p(logits, [0.75]).isfinite().tolist() == [[True, True, False, False]]
    assert _apply_top_p(logits, [0.76]).isfinite().tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("stop_id", [len(LOGITS), len(LOGITS) + 100])
def test_a_stop_token_id_outside_the_vocabulary_is_left_out_of_the_min_tokens_mask(stop_id):
    """It can never be sampled, so there is nothing to mask (and no row to index)."""
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id])
    seq = Sequence("r", [1], params)
    logits = torch.tensor(LOGITS, dtype=torch.float32)[None, :]
    assert Sampler(eos_token_ids=frozenset({0}))(logits, [seq]) == [1]  # EOS 0 is masked
