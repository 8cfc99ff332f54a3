"""The request-group seam (minivllm/request_groups.py), without a model: a kind is made
the first time it is asked for, with the engine; the set asks every kind, in the order
they were made, and a kind that never was asked for costs nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm import request_groups
from minivllm.outputs import ModelRunnerOutput
from minivllm.request_groups import RequestGroupSet
from minivllm.stats import TokenCounts


class Kind:
    """A kind of group that owns the ids it was given and records every call."""

    made: list[Kind] = []

    def __init__(self, engine) -> None:
        self.engine, self.ids, self.calls, self.in_lockstep = engine, set(), [], False
        Kind.made.append(self)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids

    def consume(self, seq, runner_output, counts) -> bool:
        self.calls.append(("consume", seq.request_id, runner_output))
        counts.num_generation_tokens += 1
        return seq.request_id.startswith(self.prefix)

    def after_step(self, outputs, now):
        self.calls.append(("after_step", now))
        return outputs + [self.prefix]

    def abort(self, request_id):
        if request_id in self.ids:
            return True
        return False if request_id.startswith(self.prefix) else None


class Beams(Kind):
    prefix = "b"


class Samples(Kind):
    prefix = "s"


@pytest.fixture
def groups(monkeypatch):
    Kind.made = []
    monkeypatch.setattr(
        request_groups, "KINDS", {"beams": f"{__name__}.Beams", "samples": f"{__name__}.Samples"}
    )
    return RequestGroupSet(engine="the engine")


def test_a_kind_is_made_once_on_first_use_with_the_engine(groups):
    seq, output = SimpleNamespace(request_id="x"), ModelRunnerOutput()
    assert not groups.consume(seq, output, TokenCounts()) and Kind.made == []
    assert groups.after_step(["o"], 1.0) == ["o"] and groups.abort("x") is None
    assert "x" not in groups and not groups.in_lockstep
    beams = groups["beams"]
    assert groups["beams"] is beams and Kind.made == [beams] and beams.engine == "the engine"
    with pytest.raises(KeyError):
        groups["no such kind"]


def test_every_kind_is_asked_in_the_order_they_were_made(groups):
    samples, beams = groups["samples"], groups["beams"]
    samples.ids.add("s1")
    counts, output = TokenCounts(), ModelRunnerOutput()
    assert groups.consume(SimpleNamespace(request_id="b0"), output, counts)
    assert not groups.consume(SimpleNamespace(request_id="x"), output, counts)
    assert groups.consume(SimpleNamespace(request_id="s2"), output, counts)  # beams not asked
    assert counts.num_generation_tokens == 5  # samples, beams; samples, beams; samples
    assert groups.after_step(["o"], 2.0) == ["o", "s", "b"]
    assert samples.calls == [
        ("consume", "b0", output), ("consume", "x", output), ("consume", "s2", output),
        ("after_step", 2.0),
    ]  # fmt: skip
    assert beams.calls == [("consume", "b0", output), ("consume", "x", output), ("after_step", 2.0)]
    assert "s1" in groups and "b1" not in groups
    assert (groups.abort("s1"), groups.abort("b7"), groups.abort("x")) == (True, False, None)
    assert not groups.in_lockstep
    beams.in_lockstep = True
    assert groups.in_lockstep
