"""The request-group seam (minivllm/request_groups.py), without a model: a kind is made
the first time it is asked for, with the engine; the set asks every kind, in the order
they were made, and a kind that never was asked for costs nothing. Then the two kinds
(parallel_sampling.py, beam_search.py) in a real `LLMEngine` on a scripted executor: what
each queues when a request comes in, what it refuses before queueing anything, and what
aborting its id stops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minivllm import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams, request_groups
from minivllm.beam_search import BeamSearchGroup, beam_request_id
from minivllm.logprobs import compute_logprobs
from minivllm.model_info import ModelInfo
from minivllm.outputs import ModelRunnerOutput
from minivllm.parallel_sampling import child_request_id
from minivllm.request_groups import RequestGroupSet
from minivllm.sampling_params import MAX_LOGPROBS
from minivllm.sequence import FinishReason
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


# --- the two kinds in a real engine, on a scripted executor ---------------------------------

EOS = 0
VOCAB = 8
PROMPT = {"prompt_token_ids": [1, 2, 3]}
# Each beam's next-token logits: token 1 best, then 2, 3, ...; EOS last.
LOGITS = torch.tensor([[-9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])


class ScriptedExecutor:
    """The executor seam: every sampling chunk gets token 1, and the logprobs it asked for
    from `LOGITS`."""

    num_kv_blocks, max_model_len, device = 64, 32, torch.device("cpu")

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        for chunk in scheduler_output.chunks:
            if chunk.sample:
                output.sampled_token_ids[chunk.request_id] = [1]
                if chunk.sampling_params.logprobs is not None:
                    output.logprobs[chunk.request_id] = compute_logprobs(
                        LOGITS, [1], [chunk.sampling_params.logprobs]
                    )
        return output

    def shutdown(self) -> None:
        pass


def make_engine(clock=lambda: 5.0, **config) -> LLMEngine:
    settings = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4} | config
    config = EngineConfig(async_scheduling=False, **settings)
    model_info = ModelInfo(SimpleNamespace(vocab_size=VOCAB), None, frozenset({EOS}))
    return LLMEngine(config, executor=ScriptedExecutor(), model_info=model_info, clock=clock)


def queued(engine: LLMEngine) -> list[str]:
    return sorted(engine.scheduler.requests)


# --- parallel sampling (n > 1) ---------------------------------------------------------


def test_n_children_are_queued_with_their_own_seeds_sharing_the_prompt():
    engine = make_engine()
    engine.add_request("p", PROMPT, SamplingParams(n=3, seed=10, max_tokens=2), arrival_time=2.5)
    children = [engine.scheduler.requests[child_request_id("p", i)] for i in range(3)]
    assert queued(engine) == ["0_p", "1_p", "2_p"] and "p" in engine.request_groups
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert {c.sampling_params.n for c in children} == {1}
    assert all(c.shares_prompt and c.metrics.arrival_time == 2.5 for c in children)
    assert all(c.prompt_token_ids == [1, 2, 3] for c in children)


def test_n_above_max_num_seqs_or_a_child_id_in_flight_queues_nothing():
    engine = make_engine()
    with pytest.raises(ValueError, match=r"^n=5 is more than max_num_seqs=4: the n samples"):
        engine.add_request("p", PROMPT, SamplingParams(n=5))
    assert queued(engine) == [] and "p" not in engine.request_groups
    engine.add_request("1_p", PROMPT, SamplingParams())  # an n = 1 request with a child's id
    with pytest.raises(ValueError, match=r"^a child id of request 'p' is already in flight$"):
        engine.add_request("p", PROMPT, SamplingParams(n=2))
    assert queued(engine) == ["1_p"] and "p" not in engine.request_groups


def test_aborting_a_parent_stops_every_child_and_only_a_parent_id_is_its_own():
    engine = make_engine()
    engine.add_request("p", PROMPT, SamplingParams(n=2, max_tokens=4))
    engine.add_request("q", PROMPT, SamplingParams(max_tokens=4))
    groups = engine.request_groups["parallel_sampling"]
    assert groups.abort("0_p") is None  # a child's id is a request of its own
    assert groups.abort("q") is None and groups.abort("nobody") is None
    assert engine.abort_request("0_p") is True  # through the engine: that one child
    assert queued(engine) == ["1_p", "q"] and "p" in engine.request_groups
    assert groups.abort("p") is True  # the child still in flight
    assert queued(engine) == ["q"] and "p" not in engine.request_groups
    assert groups.abort("p") is None  # forgotten
    engine.add_request("r", PROMPT, SamplingParams(n=2))
    engine.abort_request(["0_r", "1_r"])
    assert groups.abort("r") is False  # a parent with no child left in flight


def test_a_child_row_is_an_ordinary_requests_and_the_step_gathers_per_parent():
    engine = make_engine()
    engine.add_request("p", PROMPT, SamplingParams(n=2, max_tokens=1))
    groups = engine.request_groups["parallel_sampling"]
    seq = engine.scheduler.requests["0_p"]
    counts = TokenCounts()
    assert groups.consume(seq, ModelRunnerOutput({"0_p": [1]}), counts) is False
    assert counts == TokenCounts()
    outputs = engine.step()
    assert [(o.request_id, len(o.outputs), o.finished) for o in outputs] == [("p", 2, True)]
    assert groups.after_step(["other"], 0.0) == ["other"]  # nothing in flight: passed through


# --- beam search ---------------------------------------------------------------------------


def test_a_beam_search_request_queues_its_first_beam():
    engine = make_engine()
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    engine.add_beam_search_request("b", PROMPT, params, arrival_time=1.5)
    [seq] = engine.scheduler.requests.values()
    assert seq.request_id == beam_request_id("b", 0) == "beam0_b"
    assert seq.metrics.arrival_time == 1.5 and seq.shares_prompt is True  # share_forked_blocks
    assert seq.sampling_params == BeamSearchGroup.sampling_params(params, 1)
    assert seq.sampling_params.logprobs == 4  # 2 candidates a beam, 1 EOS id
    group = engine.request_groups["beam_search"].groups["b"]
    assert group.max_tokens == 5 and group.beam_ids == ["beam0_b"]
    assert "b" in engine.request_groups and engine.request_groups.in_lockstep
    engine.add_beam_search_request("c", PROMPT, params)  # no arrival time: the clock's
    assert engine.scheduler.requests["beam0_c"].metrics.arrival_time == 5.0
    engine.add_beam_search_request("d", PROMPT, BeamSearchParams(4, max_tokens=2))  # = max
    assert engine.scheduler.requests["beam0_c"].metrics.arrival_time == 5.0


def test_a_beam_shares_its_prompt_only_when_forked_blocks_are_shared():
    engine = make_engine(share_forked_blocks=False)
    engine.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=3))
    assert engine.scheduler.requests["beam0_b"].shares_prompt is False


@pytest.mark.parametrize(
    ("max_tokens", "prompt_len", "expected"),
    [(5, 3, 5), (40, 3, 29), (40, 31, 1), (40, 32, 1)],  # max_model_len 32
)
def test_a_search_stops_at_max_tokens_or_at_the_models_length(max_tokens, prompt_len, expected):
    engine = make_engine()
    prompt = {"prompt_token_ids": [1] * prompt_len}  # a full-length prompt: one token
    engine.add_beam_search_request("b", prompt, BeamSearchParams(2, max_tokens))
    assert engine.request_groups["beam_search"].groups["b"].max_tokens == expected


def test_bad_beam_search_requests_are_refused_before_anything_is_queued():
    engine = make_engine()
    groups = engine.request_groups["beam_search"]
    with pytest.raises(ValueError, match=r"^params must be BeamSearchParams, got SamplingParams$"):
        groups.add_request("b", PROMPT, SamplingParams(), None)
    with pytest.raises(ValueError, match=r"^beam_width=5 is more than max_num_seqs=4: the beams"):
        engine.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=5, max_tokens=2))
    assert queued(engine) == [] and "b" not in engine.request_groups
    engine.add_request("beam0_b", PROMPT, SamplingParams())  # a first beam's id, taken
    with pytest.raises(ValueError, match=r"^a beam id of request 'b' is already in flight$"):
        engine.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match=r"^request id 'beam0_b' is already in flight$"):
        engine.add_beam_search_request(
            "beam0_b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=2)
        )
    assert queued(engine) == ["beam0_b"] and "b" not in engine.request_groups


def test_more_logprobs_than_allowed_or_the_static_policy_is_refused():
    # 2 EOS ids: each beam asks for 3 candidates per beam; 7 beams ask for 21 > 20.
    engine = make_engine(max_num_seqs=8)
    engine.model_info.eos_token_ids = frozenset({0, 7})
    groups = engine.request_groups["beam_search"]
    with pytest.raises(ValueError, match=r"^beam_width=7 asks each beam for 21 logprobs with "):
        groups.add_request("b", PROMPT, BeamSearchParams(beam_width=7, max_tokens=2), None)
    assert MAX_LOGPROBS == 20 and queued(engine) == []
    groups.add_request("b", PROMPT, BeamSearchParams(beam_width=6, max_tokens=2), None)
    assert engine.scheduler.requests["beam0_b"].sampling_params.logprobs == 18
    engine.model_info.eos_token_ids = frozenset({0, 5, 6, 7})  # 5 candidates a beam
    groups.add_request("c", PROMPT, BeamSearchParams(beam_width=4, max_tokens=2), None)
    assert engine.scheduler.requests["beam0_c"].sampling_params.logprobs == 20  # the most
    static = make_engine(scheduling_policy="static")
    with pytest.raises(ValueError, match=r"^beam search needs the continuous scheduling policy$"):
        static.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=2))
    assert queued(static) == []


def test_aborting_a_search_stops_every_live_beam_and_a_beam_id_is_not_a_request():
    engine = make_engine()
    engine.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=6))
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=6))
    engine.step()  # the first beam's candidates: two beams go on (a fork)
    assert queued(engine) == ["beam0_b", "beam1_b", "x"]
    # A beam's row counts one token, and its prompt with its first row (as vLLM counts).
    stats = engine.last_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (6, 2)  # beam0_b, x
    dropped = engine.scheduler.requests["beam1_b"]
    engine.step()  # each beam reports one row: the group picks again
    stats = engine.last_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (0, 3)
    # Both best continuations extend beam 0 (1 then 2; 0+2 ties 1+1, the earlier beam
    # wins): beam 1 is dropped, beam 2 forked from beam 0.
    assert queued(engine) == ["beam0_b", "beam2_b", "x"]
    assert dropped.finish_reason == FinishReason.ABORT  # pruned, its blocks back
    beams = [engine.scheduler.requests[b] for b in ("beam0_b", "beam2_b")]
    assert [b.output_token_ids for b in beams] == [[1, 1], [1, 2]]
    assert [b.metrics.token_times for b in beams] == [[5.0, 5.0], [5.0]]  # a fork: from its step
    groups = engine.request_groups["beam_search"]
    assert groups.abort("beam2_b") is False and groups.abort("x") is None
    assert groups.abort("nobody") is None and queued(engine)[:2] == ["beam0_b", "beam2_b"]
    assert engine.abort_request("b") is True
    assert queued(engine) == ["x"] and "b" not in engine.request_groups
    assert [s.finish_reason for s in beams] == [FinishReason.ABORT] * 2
    assert groups.abort("b") is None and groups.abort("beam0_b") is None


def test_two_searches_count_both_prompts_and_one_that_fails_ends_alone():
    engine = make_engine()
    engine.add_beam_search_request("b", PROMPT, BeamSearchParams(2, 4), arrival_time=1.0)
    engine.add_beam_search_request("c", {"prompt_token_ids": [4, 5]}, BeamSearchParams(2, 4))
    engine.step()
    stats = engine.last_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (5, 2)  # 3 + 2 prompt
    groups = engine.request_groups["beam_search"]

    def fail(now):
        raise RuntimeError("boom")

    groups.groups["b"].step = fail  # b's next decision fails; c goes on
    first_beam = engine.scheduler.requests["beam0_b"]
    outputs = engine.step()
    [failed] = [o for o in outputs if o.request_id == "b"]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.error == "RuntimeError: boom" and failed.prompt_token_ids == [1, 2, 3]
    assert failed.metrics is first_beam.metrics and failed.metrics.arrival_time == 1.0
    assert queued(engine) == ["beam0_c", "beam2_c"] and "b" not in engine.request_groups


def test_a_finished_search_reports_once_with_its_text_and_is_forgotten():
    engine = make_engine()
    engine.model_info.tokenizer = SimpleNamespace(decode=lambda ids: "-".join(map(str, ids)))
    engine.add_beam_search_request("b", PROMPT, BeamSearchParams(beam_width=2, max_tokens=2))
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=5))
    assert [o.request_id for o in engine.step() if o.finished] == []
    [output] = [o for o in engine.step() if o.request_id == "b"]
    assert output.finished and [c.text for c in output.outputs] == ["1-1", "1-2"]
    assert [c.finish_reason for c in output.outputs] == ["length", "length"]
    assert "b" not in engine.request_groups and queued(engine) == ["x"]
    assert engine.request_groups["beam_search"].groups == {}
