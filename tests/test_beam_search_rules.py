"""Beam search's rules, model-free: `BeamSearchGroup` driven by hand-made logprob rows.

transformers' ``generate(num_beams=k)`` rule, as the module docstring of beam_search.py
states it: the best ``2k`` candidates over all beams (``beam's cum_logprob + token's
logprob``, float32); those among the first ``k`` that end become finished hypotheses
scored ``cum_logprob / num_output_tokens ** length_penalty`` (the ``k`` best kept); the
first ``k`` that do not end are the next beams; the search stops when no beam is left,
or when ``k`` hypotheses are kept and the best beam, ended now, would not beat the worst.

Hand-computed steps pin the forks, drops and scores; a property test plays random
"models" (a logprob row per output prefix) against a small independent reference of
that rule, written over whole token tuples.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.beam_search import (
    BeamSearchGroup,
    BeamSearchGroups,
    beam_request_id,
    beams_to_keep,
    to_beam_search_output,
)
from minivllm.outputs import Logprob
from minivllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from minivllm.sequence import Sequence

EOS = 2
PROMPT = [7, 8, 9]
f32 = np.float32


def make_group(k, max_tokens=8, eos=(EOS,), length_penalty=1.0, ignore_eos=False, rid="r"):
    params = BeamSearchParams(
        beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    first = Sequence(rid, PROMPT, BeamSearchGroup.sampling_params(params, len(eos)), "hi", 5.0)
    return BeamSearchGroup(rid, params, first, frozenset(eos), max_tokens)


def row(logprobs: dict[int, float]) -> dict[int, Logprob]:
    return {token: Logprob(lp) for token, lp in logprobs.items()}


def report(group, *rows):
    """Every live beam reports its row (in beam order), then the group decides."""
    assert len(rows) == len(group.beams)
    for beam, r in zip(list(group.beams), rows):
        assert not group.ready
        group.record(beam.seq, row(r))
    assert group.ready
    return group.step(now=1.0)


def live(group):
    return [(b.seq.output_token_ids, b.cum_logprob) for b in group.beams]


def test_beams_fork_continue_and_drop_as_hand_computed():
    group = make_group(2, max_tokens=4)
    first = group.beams[0].seq

    # Step 1: one beam; its two best tokens both go on: it extends with 10, forks with 11.
    step = report(group, {10: -0.1, 11: -0.5, 12: -2.0, EOS: -3.0})
    child = group.beams[1].seq
    assert step.forks == [(first, child)] and step.dropped == []
    assert child.request_id == beam_request_id("r", 1) == "beam1_r"
    assert child.token_ids == PROMPT + [11] and first.token_ids == PROMPT + [10]
    assert child.prompt == "hi" and child.metrics.arrival_time == 5.0
    assert child.sampling_params is first.sampling_params
    assert live(group) == [([10], f32(-0.1)), ([11], f32(-0.5))]
    assert group.beam_ids == ["r", "beam1_r"] and group.num_output_tokens == 1

    # Step 2: the child's 30 (-0.7) beats the first's 20 (-1.1): both go on, best first.
    step = report(group, {20: -1.0, 21: -1.1, EOS: -4.0}, {30: -0.2, 31: -3.0, EOS: -5.0})
    assert step.forks == [] and step.dropped == []
    assert live(group) == [([11, 30], f32(-0.5) + f32(-0.2)), ([10, 20], f32(-1.1))]
    assert group.hypotheses == []

    # Step 3: the child's EOS is the best candidate: a hypothesis, and the child is dropped;
    # the other beam goes on twice (a fork).
    third_child_parent = group.beams[1].seq
    step = report(group, {EOS: -0.05, 40: -2.0}, {50: -0.3, 51: -0.4, EOS: -3.0})
    assert step.dropped == [child]
    assert [p for p, _ in step.forks] == [third_child_parent]
    assert step.forks[0][1].request_id == "beam2_r"
    assert step.forks[0][1].token_ids == PROMPT + [10, 20, 51]
    assert [b.seq.output_token_ids for b in group.beams] == [[10, 20, 50], [10, 20, 51]]
    [h] = group.hypotheses
    cum = f32(-0.5) + f32(-0.2) + f32(-0.05)
    assert h.token_ids == [11, 30, EOS] and h.finish_reason == "stop"
    assert h.cum_logprob == cum and h.score == cum / f32(3.0)
    assert [list(r) for r in h.logprobs] == [[10, 11, 12, EOS], [30, 31, EOS], [EOS, 40]]
    assert not group.finished

    # Step 4 = max_tokens: every candidate ends; the first two become hypotheses and the
    # two best of the three are kept, by their length-penalized scores.
    step = report(group, {60: -0.01, 61: -5.0}, {70: -0.02, 71: -6.0})
    assert group.finished and group.beams == [] and step.forks == []
    assert step.dropped == [b for b in step.dropped] and len(step.dropped) == 2
    assert [h.token_ids for h in group.hypotheses] == [[11, 30, EOS], [10, 20, 50, 60]]
    assert group.hypotheses[1].finish_reason == "length"
    assert group.hypotheses[1].score == (f32(-1.1) + f32(-0.3) + f32(-0.01)) / f32(4.0)

    out = group.make_output(FakeTokenizer())
    assert out.request_id == "r" and out.finished and out.prompt == "hi"
    assert out.prompt_token_ids == PROMPT
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == ["11 30", "10 20 50 60"]  # EOS not in the text
    assert [c.token_ids for c in out.outputs] == [[11, 30, EOS], [10, 20, 50, 60]]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert out.outputs[0].cumulative_logprob == float(cum)
    assert out.outputs[0].logprobs is group.hypotheses[0].logprobs
    assert [c.text for c in group.make_output(None).outputs] == ["", ""]

    beams = to_beam_search_output(out).sequences
    assert [s.tokens for s in beams] == [PROMPT + [11, 30, EOS], PROMPT + [10, 20, 50, 60]]
    assert [s.text for s in beams] == ["11 30", "10 20 50 60"]
    assert [s.finish_reason for s in beams] == ["stop", "length"]
    assert beams[0].cum_logprob == float(cum) and beams[0].logprobs is out.outputs[0].logprobs


class FakeTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_to_beam_search_output_without_logprobs_gives_an_empty_list():
    group = make_group(1, max_tokens=1)
    report(group, {5: -0.5})
    out = group.make_output(None)
    out.outputs[0].logprobs = None
    assert to_beam_search_output(out).sequences[0].logprobs == []


def test_an_eos_after_the_first_k_candidates_is_no_hypothesis():
    group = make_group(1)
    report(group, {5: -0.1, EOS: -0.2})
    assert group.hypotheses == [] and live(group) == [([5], f32(-0.1))]


def test_the_search_stops_when_the_best_beam_cannot_beat_the_worst_hypothesis():
    # k = 1: EOS (-0.3) is the best candidate; the best beam, -0.5, cannot beat it: stop.
    group = make_group(1)
    step = report(group, {EOS: -0.3, 5: -0.5})
    assert group.finished and step.dropped and group.beams == []
    assert [h.token_ids for h in group.hypotheses] == [[EOS]]


def test_a_tie_with_the_worst_hypothesis_stops_too():
    # EOS (id 2) and token 5 score the same: EOS ranks first (smaller id), and a beam that
    # only equals the hypothesis cannot beat it.
    group = make_group(1)
    report(group, {EOS: -0.25, 5: -0.25})
    assert group.finished and len(group.hypotheses) == 1


def test_the_search_goes_on_while_fewer_than_k_hypotheses_are_kept():
    group = make_group(2)
    report(group, {EOS: -0.1, 5: -0.5, 6: -0.6})
    assert not group.finished and len(group.hypotheses) == 1
    assert live(group) == [([5], f32(-0.5)), ([6], f32(-0.6))]


def test_the_stopping_rule_compares_length_penalized_scores():
    # k = 1, length_penalty 2. Step 1: EOS -1.0 and token 5 at -1.1 (score -1.1 after one
    # token: below the hypothesis' -1.0 -> stop). With an EOS at -1.2 instead, the beam goes
    # on; at step 2 its best continuation, -1.6, penalized by 2**2 = -0.4, beats -1.2: it
    # goes on (unpenalized, -1.6 would not).
    group = make_group(1, length_penalty=2.0)
    report(group, {5: -1.1, EOS: -1.0})
    assert group.finished

    group = make_group(1, length_penalty=2.0)
    report(group, {5: -1.0, EOS: -1.2})
    assert not group.finished and group.hypotheses == []
    report(group, {EOS: -0.2, 6: -0.6})  # hypothesis -1.2 / 4 = -0.3; beam -1.6 / 4 = -0.4
    assert group.finished and group.hypotheses[0].score == f32(-1.2) / f32(4.0)

    group = make_group(1, length_penalty=2.0)
    report(group, {5: -1.0, EOS: -1.2})
    report(group, {EOS: -0.4, 6: -0.3})  # hypothesis -1.4 / 4; beam -1.3 / 4 beats it
    assert not group.finished and live(group) == [([5, 6], f32(-1.0) + f32(-0.3))]


def test_hypotheses_keep_the_k_best_and_an_older_one_wins_a_tie():
    group = make_group(2, eos=(EOS, 3))
    assert group.num_candidates == 6
    report(group, {EOS: -0.5, 3: -0.5, 5: -0.6, 6: -0.7, 7: -0.8})
    # Both EOS ids end among the first 2: two hypotheses, equal scores, smaller id first.
    assert [h.token_ids for h in group.hypotheses] == [[EOS], [3]]
    assert group.finished and group.beams == []  # -0.6 cannot beat the worst (-0.5)


def test_an_older_hypothesis_stays_ahead_of_an_equal_newer_one():
    # Step 1: EOS at -0.5 (score -0.5 / 1); step 2: beam 5 (-0.25) + EOS (-0.75) = -1.0,
    # over two tokens -1.0 / 2 = -0.5: a tie, and the older hypothesis stays first.
    group = make_group(2)
    report(group, {EOS: -0.5, 5: -0.25, 6: -3.0})
    assert [h.token_ids for h in group.hypotheses] == [[EOS]]
    report(group, {EOS: -0.75, 7: -4.0}, {EOS: -9.0, 8: -9.5})
    assert [h.token_ids for h in group.hypotheses] == [[EOS], [5, EOS]]
    assert group.hypotheses[0].score == group.hypotheses[1].score == f32(-0.5)


def test_equal_scores_rank_the_earlier_beam_then_the_smaller_token_first():
    group = make_group(2)
    report(group, {10: -1.0, 11: -1.0, 12: -5.0})
    assert [b.seq.output_token_ids for b in group.beams] == [[10], [11]]
    # Both beams at -1.0; equal rows: the earlier beam's token, then its next token id.
    report(group, {21: -0.5, 20: -0.5}, {20: -0.5, 21: -0.5})
    assert [b.seq.output_token_ids for b in group.beams] == [[10, 20], [10, 21]]


def test_each_row_gives_at_most_num_candidates_tokens():
    # k = 1 keeps 2 candidates; the single beam's row holds 4 tokens: its two best count.
    group = make_group(1, eos=(EOS,))
    assert group.num_candidates == 2
    group.record(group.beams[0].seq, row({5: -0.1, 6: -0.2, 7: -0.3, 8: -0.4}))
    candidates = group._top_candidates()
    assert [(c.token_id, c.score) for c in candidates] == [(5, f32(-0.1)), (6, f32(-0.2))]


def test_ignore_eos_makes_eos_an_ordinary_token():
    group = make_group(1, max_tokens=3, ignore_eos=True)
    assert group.eos_token_ids == frozenset() and group.num_candidates == 2
    report(group, {EOS: -0.1, 5: -0.2})
    assert group.hypotheses == [] and live(group) == [([EOS], f32(-0.1))]


def test_a_beam_ends_at_max_tokens_with_finish_reason_length():
    group = make_group(1, max_tokens=2)
    report(group, {5: -0.1})
    assert not group.finished
    report(group, {6: -0.1, EOS: -0.3})
    assert group.finished
    [h] = group.hypotheses
    assert h.token_ids == [5, 6] and h.finish_reason == "length"


def test_record_keeps_the_first_row_of_a_round():
    group = make_group(1)
    seq = group.beams[0].seq
    assert group.record(seq, row({5: -0.1})) is True
    assert group.record(seq, row({6: -0.01})) is False  # a recomputed beam again: ignored
    report_step = group.step(now=2.0)
    assert seq.output_token_ids == [5] and report_step.dropped == []
    assert group.rows == {} and not group.ready  # the next round starts empty


def test_a_fork_carries_shares_prompt_and_the_step_time():
    group = make_group(2)
    group.beams[0].seq.shares_prompt = True
    group.record(group.beams[0].seq, row({5: -0.1, 6: -0.2}))
    [(parent, child)] = group.step(now=3.5).forks
    assert child.shares_prompt is True
    assert child.metrics.first_token_time == 3.5 == parent.metrics.first_token_time
    assert child.metrics.token_times == [3.5]


def test_beams_to_keep_and_each_beams_sampling_params():
    assert [beams_to_keep(3, n) for n in (0, 1, 2, 3)] == [6, 6, 9, 12]
    params = BeamSearchGroup.sampling_params(BeamSearchParams(beam_width=3, max_tokens=5), 2)
    assert params.temperature == 0.0 and params.max_tokens is None and params.ignore_eos
    assert params.logprobs == 9 and params.output_kind == RequestOutputKind.FINAL_ONLY
    assert isinstance(params, SamplingParams)


def test_the_groups_index_follows_forks_drops_and_pops():
    groups = BeamSearchGroups()
    group = make_group(2, rid="a")
    other = make_group(1, rid="b")
    groups.add(group)
    groups.add(other)
    assert "a" in groups and "b" in groups and "c" not in groups
    assert groups.group_of == {"a": group, "b": other}
    step = report(group, {10: -0.1, 11: -0.2})
    groups.update_beams(group, step)
    assert groups.group_of == {"a": group, "beam1_a": group, "b": other}
    step = report(group, {EOS: -0.01, 3: -9.0}, {20: -0.1, 21: -0.2})  # "a" ends, forks
    groups.update_beams(group, step)
    assert groups.group_of == {"beam1_a": group, "beam2_a": group, "b": other}
    assert groups.pop("a") is group and "a" not in groups
    assert groups.group_of == {"b": other}
    assert groups.pop("a") is None and groups.group_of == {"b": other}


# --- the property: against an independent reference of transformers' rule -------------


def reference_beam_search(model, k, max_tokens, eos, length_penalty, keep):
    """transformers' rule over whole token tuples: returns the running beams after each
    step and the final hypotheses as (score, tokens, cum_logprob)."""
    beams = [((), f32(0.0))]
    finished: list[tuple[np.float32, tuple, np.float32]] = []
    history = []
    for length in range(1, max_tokens + 1):
        scored = [
            (cum + f32(lp), b, token)
            for b, (tokens, cum) in enumerate(beams)
            for token, lp in model(tokens).items()
        ]
        scored.sort(key=lambda s: (-s[0], s[1], s[2]))
        penalty = f32(length**length_penalty)
        running = []
        for rank, (score, b, token) in enumerate(scored[:keep]):
            tokens = beams[b][0] + (token,)
            if token in eos or length == max_tokens:
                if rank < k:
                    finished.append((score / penalty, tokens, score))
            elif len(running) < k:
                running.append((tokens, score))
        finished = sorted(finished, key=lambda h: -h[0])[:k]
        if running and len(finished) == k and not running[0][1] / penalty > finished[-1][0]:
            running = []
        history.append(running)
        if not running:
            break
        beams = running
    return history, finished


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 3),
    vocab=st.integers(4, 7),
    max_tokens=st.integers(1, 5),
    num_eos=st.integers(0, 2),
    length_penalty=st.sampled_from([1.0, 0.5, 2.0, -1.0]),
    seed=st.integers(0, 2**16),
)
def test_beams_equal_a_reference_of_transformers_rule(
    k, vocab, max_tokens, num_eos, length_penalty, seed
):
    eos = tuple(range(num_eos))

    def model(tokens):  # a fixed random distribution per prefix, no ties
        rng = np.random.default_rng([seed, *tokens])
        logits = rng.normal(size=vocab) * 2
        logprobs = logits - np.log(np.exp(logits).sum())
        return {t: float(lp) for t, lp in enumerate(logprobs)}

    group = make_group(k, max_tokens, eos=eos, length_penalty=length_penalty)
    history, finished = reference_beam_search(
        model, k, max_tokens, eos, length_penalty, beams_to_keep(k, len(eos))
    )
    for running in history:
        assert not group.finished
        for beam in group.beams:
            group.record(beam.seq, row(model(tuple(beam.seq.output_token_ids))))
        group.step(now=0.0)
        assert [(tuple(t), c) for t, c in live(group)] == running
    assert group.finished
    assert [(h.score, tuple(h.token_ids), h.cum_logprob) for h in group.hypotheses] == finished
    for h in group.hypotheses:
        assert h.finish_reason == ("stop" if h.token_ids[-1] in eos else "length")


@pytest.mark.parametrize("k", [1, 2])
def test_every_chosen_beam_is_its_own_sequence(k):
    group = make_group(k)
    report(group, {5: -0.1, 6: -0.2, 7: -0.3})
    seqs = [b.seq for b in group.beams]
    assert len({id(s) for s in seqs}) == len(seqs) == k


def test_the_group_decides_only_once_every_beam_has_reported_and_never_after_the_end():
    group = make_group(2, max_tokens=2)
    report(group, {5: -0.1, 6: -0.2})
    group.record(group.beams[0].seq, row({7: -0.1}))  # one of two beams has reported
    with pytest.raises(AssertionError):
        group.step(now=0.0)
    group.record(group.beams[1].seq, row({8: -0.1}))
    group.step(now=0.0)
    assert group.finished and group.ready  # no beam left: nothing to wait for
    with pytest.raises(AssertionError):
        group.step(now=0.0)


@pytest.mark.parametrize(
    ("max_tokens", "length_penalty", "ok"),
    [(16, 24.9, True), (16, 25.0, False), (16, -24.9, True), (8192, 7.6, True),
     (8192, 7.7, False), (8192, 1000.0, False), (1, 1e300, True), (512, 2.0, True)],
)  # fmt: skip
def test_length_penalties_that_would_overflow_are_refused_up_front(max_tokens, length_penalty, ok):
    """``num_tokens ** length_penalty`` must stay within 1e+-30 at any length up to
    max_tokens: beyond, 1000 raised OverflowError inside a step (failing every request
    sharing it), and smaller values overflowed float32 (every score -0.0)."""
    if ok:
        BeamSearchParams(2, max_tokens, length_penalty=length_penalty)
        factor = np.float32(float(max_tokens) ** abs(length_penalty)) if max_tokens > 1 else 1
        assert np.isfinite(factor) and factor * np.float32(1e8) < np.finfo(np.float32).max
    else:
        with pytest.raises(ValueError, match=rf"length_penalty must be in \[-.*for max_tokens="
                           rf"{max_tokens} .*got {length_penalty}"):  # fmt: skip
            BeamSearchParams(2, max_tokens, length_penalty=length_penalty)
