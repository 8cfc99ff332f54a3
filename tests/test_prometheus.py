"""The Prometheus exporter's counters equal what the requests' usage says.

A real engine on a tiny random model with a small KV pool and prefix caching on, driven
step by step, with `ServerMetrics` listening as it does behind ``minivllm serve``: prompts
that share a prefix (cache hits), more than the pool holds (preemptions, so prompts are
recomputed), a streamed and a plain request aborted mid-answer. Every counter is checked
against the requests themselves: ``prompt_tokens`` counts each prompt once, cached tokens
included, however often it was recomputed; ``generation_tokens`` counts every output token,
the aborted requests' too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from minivllm.entrypoints.async_llm import StepRecord
from minivllm.entrypoints.prometheus import ServerMetrics
from tests.helpers import make_tiny_checkpoint

pytest.importorskip("prometheus_client")

SHARED_PREFIX = list(range(10, 22))  # three full blocks of 4


def counter(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
    assert value is not None, name
    return value


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("prometheus"), "llama")
    config = EngineConfig(
        model=str(path), num_kv_blocks=10, block_size=4, max_num_seqs=4,
        max_num_batched_tokens=32, enable_prefix_caching=True, attention_backend="torch",
        async_scheduling=False,  # each step's stats and outputs are that step's
    )  # fmt: skip
    return LLMEngine(config)


def test_counters_equal_the_requests_usage(engine):
    async_llm = SimpleNamespace(
        engine=engine, step_listeners=[], abort_listeners=[], error_listeners=[]
    )
    metrics = ServerMetrics(async_llm, "tiny")
    prompts = {str(i): SHARED_PREFIX + [30 + i, 40 + i] for i in range(6)}
    finals, seqs, num_steps = {}, {}, 0

    def params(kind=RequestOutputKind.FINAL_ONLY, max_tokens=10):
        return SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind
        )

    def add(request_id, kind=RequestOutputKind.FINAL_ONLY, max_tokens=10):
        engine.add_request(request_id, {"prompt_token_ids": prompts[request_id]},
                           params(kind, max_tokens))  # fmt: skip
        seqs[request_id] = engine.scheduler.requests[request_id]

    def step():
        nonlocal num_steps
        outputs = engine.step()
        num_steps += 1
        for listener in async_llm.step_listeners:
            listener(StepRecord(num_steps, engine.last_stats), outputs)
        finals.update({o.request_id: o for o in outputs if o.finished})

    def abort(request_id):
        assert engine.abort_request(request_id)
        for listener in async_llm.abort_listeners:
            listener(request_id)

    add("0")
    step()  # "0" caches the shared prefix
    add("1", RequestOutputKind.DELTA, max_tokens=40)  # streamed, aborted below
    add("2", max_tokens=40)  # plain, aborted below
    for request_id in "345":
        add(request_id)
    for _ in range(6):
        step()
    assert seqs["1"].num_output_tokens > 0 and seqs["2"].num_output_tokens > 0
    abort("1")
    abort("2")
    while engine.has_unfinished_requests():
        step()

    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0, "the pool was meant to preempt"
    assert stats["prefix_cache_hit_tokens"] > 0, "the prefix was meant to be shared"
    recomputed = [s for s in seqs.values() if s.metrics.num_preemptions]
    assert recomputed, "a preempted request recomputes its prompt"
    finished = {r: finals[r] for r in "0345"}
    aborted = [seqs["1"], seqs["2"]]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finished.values())
    prompt_tokens += sum(s.num_prompt_tokens for s in aborted)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in finished.values())
    completion_tokens += sum(s.num_output_tokens for s in aborted)
    assert counter(metrics, "vllm:prompt_tokens_total") == prompt_tokens
    assert counter(metrics, "vllm:generation_tokens_total") == completion_tokens
    assert counter(metrics, "vllm:num_preemptions_total") == stats["num_preemptions_total"]
    queries = counter(metrics, "vllm:prefix_cache_queries_total")
    assert queries == stats["prefix_cache_query_tokens"]
    assert counter(metrics, "vllm:prefix_cache_hits_total") == stats["prefix_cache_hit_tokens"]
    success = {r: counter(metrics, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort")}  # fmt: skip
    assert success == {"stop": 0, "length": 4, "abort": 2}
    assert counter(metrics, "vllm:num_requests_running") == 0
    assert counter(metrics, "vllm:num_requests_waiting") == 0
    assert counter(metrics, "vllm:kv_cache_usage_perc") == 0
