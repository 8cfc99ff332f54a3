"""No request can break a step for the others: an exception while the engine processes one
request's part of a step fails that request alone — a plain one, an ``n > 1`` request as a
whole group, a beam search as a whole search — with a last output whose finish_reason is
"error"; every other request finishes exactly as it would have alone, and every block
comes back. Over HTTP the failed request gets a 500 (in-band for a stream) and the server
stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest

from minivllm import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from tests.helpers import ENGINE_OPTIONS, MODEL_NAME

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests() or engine.in_flight is not None:
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals
                finals[output.request_id] = output
    return finals


def add_all(engine: LLMEngine) -> None:
    engine.add_request("plain", "w1 w2 w3", GREEDY)
    engine.add_request("other", "w4 w5", GREEDY)
    engine.add_request("pair", "w6 w7", SamplingParams(n=2, temperature=0, max_tokens=6))
    engine.add_beam_search_request("beams", "w8 w9", BeamSearchParams(2, 6, ignore_eos=True))


@pytest.mark.parametrize("victim", ["plain", "1_pair", "beam0_beams", "beam-decision"])
def test_a_request_that_fails_in_a_step_fails_alone(tiny_llama_path, monkeypatch, victim):
    config = EngineConfig(model=str(tiny_llama_path), **ENGINE_OPTIONS)
    alone = LLMEngine(config)
    add_all(alone)
    expected = run(alone)
    engine = LLMEngine(config)
    add_all(engine)
    calls = {"n": 0}
    if victim == "beam-decision":  # the search's own arithmetic, after every beam reported
        from minivllm import beam_search

        real_step = beam_search.BeamSearchGroup.step

        def step(group, now):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OverflowError("simulated")
            return real_step(group, now)

        monkeypatch.setattr(beam_search.BeamSearchGroup, "step", step)
    else:
        processor = engine.output_processor
        real_process, real_consume = processor.process, None

        def process(seq, *args):
            if seq.request_id == victim:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise KeyError("simulated")
            return real_process(seq, *args)

        monkeypatch.setattr(processor, "process", process)
        if victim.startswith("beam"):
            groups = engine.request_groups["beam_search"]
            real_consume = groups.consume

            def consume(seq, *args):
                if seq.request_id == victim:
                    calls["n"] += 1
                    if calls["n"] == 3:
                        raise KeyError("simulated")
                return real_consume(seq, *args)

            monkeypatch.setattr(groups, "consume", consume)
    finals = run(engine)
    failed_id = {"plain": "plain", "1_pair": "pair"}.get(victim, "beams")
    assert calls["n"] >= 3
    assert set(finals) == {"plain", "other", "pair", "beams"}
    failed = finals[failed_id]
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    assert "simulated" in failed.error
    for request_id, output in finals.items():
        if request_id != failed_id:
            assert output.error is None
            assert [c.token_ids for c in output.outputs] == [
                c.token_ids for c in expected[request_id].outputs
            ], request_id
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    assert not engine.request_groups["beam_search"].groups
    assert not engine.request_groups["parallel_sampling"].parents
    assert engine.output_processor.detokenizers == {}


def test_over_http_the_failed_request_gets_a_500_and_the_server_stays_healthy(server, monkeypatch):
    engine = server.async_llm.engine
    real_process = engine.output_processor.process
    state = {"armed": True}

    def process(seq, *args):
        if state["armed"] and seq.num_output_tokens == 2:
            state["armed"] = False
            raise RuntimeError("simulated fault")
        return real_process(seq, *args)

    monkeypatch.setattr(engine.output_processor, "process", process)
    body = {"model": MODEL_NAME, "prompt": "w9", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as reply:
        events = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "simulated fault" in error["message"]
    assert events[-1] == "data: [DONE]"
    state["armed"] = True
    reply = httpx.post(server.url + "/v1/completions", json=body | {"stream": False}, timeout=30)
    assert reply.status_code == 500 and "simulated fault" in reply.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    reply = httpx.post(server.url + "/v1/completions", json=body | {"stream": False}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    metrics = httpx.get(server.url + "/metrics").text
    line = [x for x in metrics.splitlines() if 'finished_reason="error"' in x and "_total" in x]
    assert float(line[0].rsplit(" ", 1)[1]) == 2


def test_when_a_step_raises_offline_the_call_leaves_nothing_queued(tiny_llama_path, monkeypatch):
    """`LLM.generate` / `beam_search` whose step raises (an executor that lost a worker,
    Ctrl-C) aborts what it queued, ``n > 1`` requests and searches as whole groups: no
    request, group or block is left for the next call, which runs normally."""
    from minivllm import LLM

    llm = LLM(str(tiny_llama_path), **ENGINE_OPTIONS)
    engine = llm.llm_engine
    real_execute = engine.executor.execute_model
    calls = {"n": 0}

    def execute_model(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated worker death")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.executor, "execute_model", execute_model)
    pair = SamplingParams(n=2, temperature=0, max_tokens=6)
    for run_call in (
        lambda: llm.generate(["w1 w2", "w3"], [GREEDY, pair], use_tqdm=False),
        lambda: llm.beam_search("w4 w5", BeamSearchParams(2, 6, ignore_eos=True)),
    ):
        calls["n"] = 0
        with pytest.raises(RuntimeError, match="simulated worker death"):
            run_call()
        assert not engine.has_unfinished_requests() and engine.in_flight is None
        assert not engine.request_groups["parallel_sampling"].parents
        assert not engine.request_groups["beam_search"].groups
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    [out] = llm.generate("w1 w2", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
