"""Parallel sampling's bookkeeping without a model: a parent fans out into children and
gathers their outputs back (minivllm/parallel_sampling.py).

The engine tests in test_parallel_sampling.py run it on a checkpoint; these feed
`ParentRequests` hand-made child outputs, so they pin every rule of the gathering (which
choices a report holds, in which order, when a parent is forgotten) in milliseconds.
"""

from __future__ import annotations

import pytest

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.parallel_sampling import ParentRequest, ParentRequests, child_request_id
from minivllm.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
)  # fmt: skip


def child_output(
    parent: ParentRequest, index: int, token_ids: list[int], finished: bool = False, **fields
) -> RequestOutput:
    """What the output processor reports for child ``index``: an ``n = 1`` output, whose
    one completion has index 0 and the child's prompt (the parent's)."""
    text = " ".join(f"w{t}" for t in token_ids)
    return RequestOutput(
        request_id=parent.child_ids[index],
        prompt=fields.pop("prompt", "the prompt"),
        prompt_token_ids=fields.pop("prompt_token_ids", [7, 8]),
        outputs=[CompletionOutput(0, text, token_ids, "length" if finished else None)],
        finished=finished,
        **fields,
    )


def make_parents(n: int, kind=CUMULATIVE, request_id: str = "req", **params):
    parent = ParentRequest(request_id, SamplingParams(n=n, output_kind=kind, **params))
    parents = ParentRequests()
    parents.add(parent)
    return parents, parent


def test_child_ids_follow_vllm_and_map_back_to_their_parent() -> None:
    parents, parent = make_parents(3, request_id="abc")
    assert (
        parent.child_ids
        == ["0_abc", "1_abc", "2_abc"]
        == [child_request_id("abc", i) for i in range(3)]
    )
    assert "abc" in parents and "0_abc" not in parents
    assert all(parents.parent_of[c] is parent for c in parent.child_ids)


@pytest.mark.parametrize("seed", [None, 0, 41])
def test_child_i_samples_with_seed_plus_i_and_n_1(seed) -> None:
    _, parent = make_parents(3, seed=seed, temperature=0.7, max_tokens=5)
    for i in range(3):
        params = parent.child_params(i)
        assert params.n == 1
        assert params.seed == (None if seed is None else seed + i)
        assert (params.temperature, params.max_tokens) == (0.7, 5)
    assert parent.sampling_params.n == 3  # the parent's own parameters stay as they were


def test_cumulative_reports_every_choice_as_it_stands_in_index_order() -> None:
    parents, parent = make_parents(3)
    # Child 2 reports first, then child 0; child 1 has produced nothing yet.
    [out] = parents.gather([child_output(parent, 2, [5]), child_output(parent, 0, [1])])
    assert out.request_id == "req" and not out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [[1], [], [5]]
    assert [c.text for c in out.outputs] == ["w1", "", "w5"]
    # Next step only child 1 reports: the others stand as they were.
    [out] = parents.gather([child_output(parent, 1, [3, 4])])
    assert [c.token_ids for c in out.outputs] == [[1], [3, 4], [5]]


def test_delta_reports_only_the_children_that_produced_something_this_step() -> None:
    parents, parent = make_parents(3, DELTA)
    [out] = parents.gather([child_output(parent, 2, [5]), child_output(parent, 0, [1])])
    assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [1]), (2, [5])]
    [out] = parents.gather([child_output(parent, 1, [3])])
    assert [(c.index, c.token_ids) for c in out.outputs] == [(1, [3])]  # not 0 and 2 again


def test_final_only_reports_once_all_children_finished() -> None:
    parents, parent = make_parents(2, FINAL_ONLY)
    assert parents.gather([child_output(parent, 0, [1, 2], finished=True)]) == []
    assert "req" in parents  # still waiting for child 1
    [out] = parents.gather([child_output(parent, 1, [3], finished=True)])
    assert out.finished
    assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [1, 2]), (1, [3])]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]


def test_a_parent_finishes_when_its_last_child_does_and_is_then_forgotten() -> None:
    parents, parent = make_parents(2)
    [out] = parents.gather([child_output(parent, 1, [3], finished=True)])
    assert not out.finished and not parent.finished and "req" in parents
    [out] = parents.gather([child_output(parent, 0, [1], finished=True)])
    assert out.finished and parent.finished
    assert "req" not in parents and parents.parent_of == {}


def test_the_report_takes_prompt_and_metrics_from_child_0() -> None:
    parents, parent = make_parents(2)
    metrics0, metrics1 = object(), object()
    [out] = parents.gather([
        child_output(parent, 1, [3], prompt="p", prompt_token_ids=[9], metrics=metrics1,
                     num_cached_tokens=5, prompt_logprobs=[None, {9: 0.0}]),
    ])  # fmt: skip
    # Until child 0 reports, the first child that did speaks for the prompt.
    assert (out.prompt, out.prompt_token_ids, out.metrics) == ("p", [9], metrics1)
    assert (out.num_cached_tokens, out.prompt_logprobs) == (5, [None, {9: 0.0}])
    [out] = parents.gather([
        child_output(parent, 0, [1], prompt="p", prompt_token_ids=[9], metrics=metrics0,
                     num_cached_tokens=0),
    ])  # fmt: skip
    assert out.metrics is metrics0 and out.num_cached_tokens == 0
    assert out.prompt_logprobs is None
    # A later report of child 1 does not take the prompt's place back from child 0.
    [out] = parents.gather([child_output(parent, 1, [3, 4], metrics=metrics1)])
    assert out.metrics is metrics0


def test_gather_keeps_the_order_of_the_step_and_passes_n1_outputs_through() -> None:
    parents, parent_a = make_parents(2, request_id="a")
    parent_b = ParentRequest("b", SamplingParams(n=2))
    parents.add(parent_b)
    lone = RequestOutput("lone", "p", [1], [CompletionOutput(0, "w2", [2])], finished=False)
    step = [
        child_output(parent_b, 1, [4]),
        lone,
        child_output(parent_a, 0, [1]),
        child_output(parent_b, 0, [3]),  # b's second child: no second report for b
        child_output(parent_a, 1, [2]),
    ]
    outs = parents.gather(step)
    assert [o.request_id for o in outs] == ["b", "lone", "a"]
    assert outs[1] is lone
    assert [c.token_ids for c in outs[0].outputs] == [[3], [4]]
    assert [c.token_ids for c in outs[2].outputs] == [[1], [2]]


def test_pop_forgets_a_parent_and_its_children_and_ignores_unknown_ids() -> None:
    parents, parent = make_parents(3)
    other = ParentRequest("other", SamplingParams(n=2))
    parents.add(other)
    assert parents.pop("req") is parent
    assert "req" not in parents and set(parents.parent_of) == set(other.child_ids)
    assert parents.pop("req") is None and parents.pop("unknown") is None
    assert "other" in parents
