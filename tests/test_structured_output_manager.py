"""The structured-output manager on a fake grammar backend: no llguidance, no model.

Each fake matcher writes its own tag and how many tokens it has taken into the rows it
fills, so every bitmask row says exactly which matcher filled it, in which state; compiles
are futures the test completes (or fails) by hand, so the order in which grammars become
ready is the test's choice.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import torch

from minivllm import SamplingParams
from minivllm import StructuredOutputsParams as SO
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput
from minivllm.sequence import FinishReason, Sequence
from minivllm.structured_output import StructuredOutputManager

EOS = 0
REFUSED = 99  # the token every fake grammar refuses


class FakeGrammar:
    def __init__(self, tag: int):
        self.tag = tag
        self.tokens: list[int] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if REFUSED in token_ids:
            return False
        self.tokens += token_ids
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, 0] = self.tag
        bitmask[row, 1] = len(self.tokens)

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == EOS


class FakeCompiled:
    def __init__(self, tag: int):
        self.tag = tag

    def new_matcher(self) -> FakeGrammar:
        return FakeGrammar(self.tag)


def make_manager() -> StructuredOutputManager:
    return StructuredOutputManager(SimpleNamespace(eos_token_id=EOS), 64, make_backend=None)


def seq(request_id: str, regex: str) -> Sequence:
    return Sequence(request_id, [1, 2], SamplingParams(structured_outputs=SO(regex=regex)))


def held(manager: StructuredOutputManager, *requests: tuple[str, str]) -> dict[str, Future]:
    """Hold each (request id, regex); one future per distinct regex, not yet done."""
    futures: dict[str, Future] = {}
    for request_id, regex in requests:
        s = seq(request_id, regex)
        key = s.sampling_params.structured_outputs.key
        if key not in manager.cache:
            manager.cache[key] = futures[regex] = Future()
        assert manager.hold(s)
    return futures


def mask_rows(mask) -> list[tuple[int, int, int]]:
    """(sampled row, tag of the matcher that filled it, tokens it had taken); -1 tags: unfilled."""
    return [(row, int(w[0]), int(w[1])) for row, w in zip(mask.rows, mask.bitmask)]


def test_fill_rows_returns_the_row_after_its_own():
    """The next request's first row: one row per sampled token, drafts included, even
    after a refused draft (its rows stay "anything")."""
    bitmask = torch.full((11, 2), -1, dtype=torch.int32)
    grammar = FakeGrammar(7)
    assert StructuredOutputManager._fill_rows(grammar, [], bitmask, 2) == 3
    assert StructuredOutputManager._fill_rows(grammar, [4, 5], bitmask, 3) == 6
    assert StructuredOutputManager._fill_rows(grammar, [4, REFUSED, 5], bitmask, 6) == 10
    assert bitmask[:2].eq(-1).all() and bitmask[8:].eq(-1).all()
    assert [tuple(r) for r in bitmask[2:8].tolist()] == [
        (7, 0), (7, 0), (7, 1), (7, 2), (7, 0), (7, 1)
    ]  # fmt: skip
    assert grammar.tokens == []  # rolled back every time


def test_each_constrained_request_gets_its_own_rows_after_drafts():
    """Three constrained requests, the first two with drafts, between free and mid-prompt
    chunks: every row is filled by its own request's matcher at its own draft depth."""
    manager = make_manager()
    manager.requests = {"a": FakeGrammar(1), "b": FakeGrammar(2), "c": FakeGrammar(3)}
    out = SchedulerOutput()
    out.chunks = [
        ScheduledChunk("a", [5, 6, 7], 3, (), sample=True, num_draft_tokens=2),
        ScheduledChunk("free", [5, 6], 3, (), sample=True, num_draft_tokens=1),
        ScheduledChunk("b", [5, 6], 3, (), sample=True, num_draft_tokens=1),
        ScheduledChunk("mid", [5, 6, 7], 0, (), sample=False),
        ScheduledChunk("c", [5], 3, (), sample=True),
    ]
    mask = manager.grammar_bitmask(out)
    assert mask_rows(mask) == [(0, 1, 0), (1, 1, 1), (2, 1, 2), (5, 2, 0), (6, 2, 1), (7, 3, 0)]
    assert manager.stats.num_masked_rows == 6
    assert all(g.tokens == [] for g in manager.requests.values())


def test_take_ready_keeps_arrival_order_and_reports_failures():
    """A grammar still compiling holds back only its own requests; failed compiles come
    back with their error and leave; ready ones get their own matcher, counted from
    their current output; the cache answers the same constraint again."""
    manager = make_manager()
    f = held(manager, ("slow", "s"), ("ok1", "k"), ("bad", "b"), ("ok2", "k"), ("bad2", "b"))
    # Every compile here is a future put in the cache beforehand: five hits.
    assert manager.stats.num_cache_hits == 5 and list(manager.waiting) == [
        "slow", "ok1", "bad", "ok2", "bad2"
    ]  # fmt: skip
    assert manager.take_ready() == ([], [])
    error = ValueError("grammar too large")
    f["k"].set_result(FakeCompiled(4))
    f["b"].set_exception(error)
    ready, failed = manager.take_ready()
    assert [s.request_id for s in ready] == ["ok1", "ok2"]
    assert [(s.request_id, e) for s, e in failed] == [("bad", error), ("bad2", error)]
    assert list(manager.waiting) == ["slow"]
    assert list(manager.requests) == ["ok1", "ok2"]
    assert manager.requests["ok1"] is not manager.requests["ok2"]
    assert manager.requests["ok1"].tag == 4 and manager.num_accepted == {"ok1": 0, "ok2": 0}
    assert manager.take_ready() == ([], [])  # each is handed out once
    f["s"].set_result(FakeCompiled(5))
    ready, failed = manager.take_ready()
    assert [s.request_id for s in ready] == ["slow"] and failed == []
    assert not manager.waiting and manager.requests["slow"].tag == 5


def test_admit_ready_adds_in_order_and_returns_failures():
    class Scheduler:
        def __init__(self, busy):
            self.busy, self.added = busy, []

        def has_unfinished_requests(self):
            return self.busy

        def add_request(self, s):
            self.added.append(s.request_id)

    manager = make_manager()
    f = held(manager, ("x", "x"), ("y", "y"), ("z", "z"))
    f["z"].set_result(FakeCompiled(1))
    f["x"].set_result(FakeCompiled(2))
    f["y"].set_exception(RuntimeError("no"))
    scheduler = Scheduler(busy=False)
    failed = manager.admit_ready(scheduler)
    assert scheduler.added == ["x", "z"] and [s.request_id for s, _ in failed] == ["y"]
    assert manager.admit_ready(Scheduler(busy=True)) == []


def test_advance_feeds_only_new_tokens_and_abort_finishes_only_waiting():
    manager = make_manager()
    f = held(manager, ("r", "r"), ("w", "w"))
    f["r"].set_result(FakeCompiled(1))
    [s], _ = manager.take_ready()
    s.append_token(5, 0.0)
    s.append_token(6, 0.0)
    assert manager.pauses_overlap()
    assert manager.advance(s, stopped=False) is False
    assert manager.requests["r"].tokens == [5, 6] and manager.num_accepted["r"] == 2
    s.append_token(EOS, 0.0)
    assert manager.advance(s, stopped=False) is True  # complete: EOS the grammar allowed
    assert manager.requests.get("r") is None and "r" not in manager.num_accepted
    assert manager.advance(s, stopped=False) is False  # gone
    w = manager.waiting["w"][0]
    assert manager.abort("w", 1.0) is True and w.finish_reason == FinishReason.ABORT
    assert manager.abort("w", 1.0) is False and not manager.waiting
    assert not manager.pauses_overlap()
