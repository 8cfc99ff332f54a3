"""The structured-output manager on a fake grammar backend: no llguidance, no model.

Each fake matcher writes its own tag and how many tokens it has taken into the rows it
fills, so every bitmask row says exactly which matcher filled it, in which state; compiles
are futures the test completes (or fails) by hand, so the order in which grammars become
ready is the test's choice.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from minivllm import SamplingParams
from minivllm import StructuredOutputsParams as SO
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput
from minivllm.sequence import FinishReason, Sequence
from minivllm.structured_output import StructuredOutputManager

EOS = 0
REFUSED = 99  # the token every fake grammar refuses


class FakeGrammar:
    """Takes any token but REFUSED; complete after EOS, or after ``limit`` tokens (then,
    as llguidance, it takes nothing more, EOS included)."""

    def __init__(self, tag: int, limit: int | None = None):
        self.tag, self.limit = tag, limit
        self.tokens: list[int] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token in token_ids:
            if token == REFUSED or self.is_terminated():
                return False
            self.tokens.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, 0] = self.tag
        bitmask[row, 1] = len(self.tokens)

    def is_terminated(self) -> bool:
        full = self.limit is not None and len(self.tokens) >= self.limit
        return full or (bool(self.tokens) and self.tokens[-1] == EOS)


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
        ScheduledChunk("c", [5, REFUSED, 6], 3, (), sample=True, num_draft_tokens=2),
    ]
    manager.stats.mask_fill_s = 5.0
    mask = manager.grammar_bitmask(out)
    assert mask_rows(mask)[:-2] == [
        (0, 1, 0),
        (1, 1, 1),
        (2, 1, 2),
        (5, 2, 0),
        (6, 2, 1),
        (7, 3, 0),
    ]
    # After the refused draft: the "anything" mask, every bit set.
    assert mask.rows[-2:] == [8, 9] and mask.bitmask[-2:].eq(-1).all()
    assert manager.stats.num_masked_rows == 8
    assert 5.0 < manager.stats.mask_fill_s < 5.5  # this step's fill time, added
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
    grammar = manager.requests["r"]
    assert manager.advance(s, stopped=False) is True  # complete: EOS the grammar allowed
    assert grammar.tokens == [5, 6, EOS]  # only the new token went in
    assert manager.requests.get("r") is None and "r" not in manager.num_accepted
    assert manager.advance(s, stopped=False) is False  # gone
    w = manager.waiting["w"][0]
    assert manager.abort("w", 1.0) is True and w.finish_reason == FinishReason.ABORT
    assert w.metrics.finished_time == 1.0
    assert manager.abort("w", 1.0) is False and not manager.waiting
    assert not manager.pauses_overlap()
    free = Sequence("free", [1], SamplingParams())
    assert manager.hold(free) is False and "free" not in manager.waiting


@pytest.mark.parametrize(
    "tokens, limit, expected_tokens, complete",
    [
        ([5, 6, EOS], None, [5, 6, EOS], True),  # EOS where the grammar is still open
        ([5, 6, EOS], 2, [5, 6], True),  # complete after 5 6: EOS implied, not taken
        ([EOS], None, [EOS], True),
        ([5, 6], None, [5, 6], False),
        ([5, 6], 2, [5, 6], False),  # complete, but without EOS: it goes on
    ],
)
def test_accept_tokens_takes_eos_only_where_the_grammar_is_open(
    tokens, limit, expected_tokens, complete, caplog
):
    manager = make_manager()
    grammar = manager.requests["r"] = FakeGrammar(1, limit)
    manager.stats.advance_s = 5.0
    with caplog.at_level(logging.ERROR, "minivllm.structured_output"):
        assert manager.accept_tokens("r", tokens) is complete
    assert grammar.tokens == expected_tokens and not caplog.records
    assert 5.0 < manager.stats.advance_s < 5.5  # this call's time, added


def test_refused_tokens_stop_the_request_with_an_error_naming_them(caplog):
    manager = make_manager()
    manager.requests["r"] = FakeGrammar(1)
    with caplog.at_level(logging.ERROR, "minivllm.structured_output"):
        assert manager.accept_tokens("r", [5, REFUSED]) is True
    assert [r.getMessage() for r in caplog.records] == [
        "request r: tokens [5, 99] refused by its grammar"
    ]


def test_async_pause_is_logged_once(caplog):
    manager = make_manager()
    manager.requests["r"] = FakeGrammar(1)
    with caplog.at_level(logging.INFO, "minivllm.structured_output"):
        assert manager.pauses_overlap() and manager.pauses_overlap()
    assert len(caplog.records) == 1 and "async scheduling paused" in caplog.records[0].message


def test_admit_ready_waits_a_moment_only_when_nothing_else_runs():
    class Scheduler:
        def __init__(self, busy):
            self.busy = busy

        def has_unfinished_requests(self):
            return self.busy

    manager = make_manager()
    f = held(manager, ("slow", "s"), ("ready", "r"))
    start = time.monotonic()
    assert manager.admit_ready(Scheduler(busy=True)) == []
    assert time.monotonic() - start < 0.04  # others run: no wait
    start = time.monotonic()
    assert manager.admit_ready(Scheduler(busy=False)) == []
    assert 0.04 < time.monotonic() - start < 0.9  # idle: a moment (0.05 s), not more
    f["r"].set_result(FakeCompiled(1))
    start = time.monotonic()
    manager.wait_for_compile(timeout=5)  # one is done: no waiting for the other
    assert time.monotonic() - start < 1


class ThreadBackend:
    """Records the thread each compile runs on; the first compile waits for ``release``."""

    def __init__(self, tokenizer, vocab_size):
        self.built_with = (tokenizer, vocab_size)
        self.release = threading.Event()
        self.threads: list[str] = []

    def compile(self, params):
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 1:
            self.release.wait(5)
        return FakeCompiled(len(self.threads))


def test_one_compile_thread_built_lazily_and_shut_down_without_waiting():
    manager = make_manager()
    manager.shutdown()  # no thread yet: nothing to do
    backends = []
    manager.make_backend = lambda t, v: backends.append(ThreadBackend(t, v)) or backends[-1]
    manager.add_request(seq("a", "a"))
    manager.add_request(seq("b", "b"))
    manager.add_request(seq("c", "c"))
    deadline = time.monotonic() + 5
    while not backends or not backends[0].threads:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)  # a second worker, if there were one, would take "b" now
    backend = backends[0]
    assert backend.threads == ["grammar_0"]  # one thread, and "b" queued behind "a"
    assert backend.built_with == (manager.tokenizer, 64)
    start = time.monotonic()
    manager.shutdown()
    assert time.monotonic() - start < 2  # does not wait for "a"'s compile
    futures = {rid: f for rid, (_, f) in manager.waiting.items()}
    assert futures["b"].cancelled() and futures["c"].cancelled()  # queued ones are dropped
    backend.release.set()
    assert futures["a"].result(5).tag == 1 and backend.threads == ["grammar_0"]
    assert len(manager.stats.compile_s) == 1 and 0 <= manager.stats.compile_s[0] < 0.5


def test_check_refuses_a_request_it_cannot_serve_before_any_work():
    manager = make_manager()
    manager.check(None, "static")  # no sampling params, or no constraint: nothing to check
    manager.check(SamplingParams(), "static")
    constrained = SamplingParams(structured_outputs=SO(regex="a+"))
    policy = "^structured_outputs needs the continuous scheduling policy$"
    with pytest.raises(ValueError, match=policy):
        manager.check(constrained, "static")
    tokenizer, manager.tokenizer = manager.tokenizer, None
    with pytest.raises(ValueError, match="^structured_outputs needs the model's tokenizer$"):
        manager.check(constrained, "continuous")
    manager.tokenizer = tokenizer
    pytest.importorskip("llguidance")
    manager.check(constrained, "continuous")
    with pytest.raises(ValueError, match="regex"):
        manager.check(SamplingParams(structured_outputs=SO(regex="(")), "continuous")
    assert not manager.waiting and manager.compile_thread is None


def test_the_default_backend_is_llguidance_on_the_models_tokenizer():
    pytest.importorskip("llguidance")
    from minivllm.structured_output.guidance import GuidanceBackend
    from minivllm.structured_output.manager import _make_guidance_backend
    from tests.structured_helpers import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    manager = StructuredOutputManager(tokenizer, 272)
    backend = manager.make_backend(manager.tokenizer, manager.vocab_size)
    assert manager.make_backend is _make_guidance_backend
    assert isinstance(backend, GuidanceBackend) and backend.vocab_size == 272
    grammar = backend.compile(SO(regex="a")).new_matcher()
    assert grammar.accept_tokens([tokenizer.convert_tokens_to_ids("a")])
