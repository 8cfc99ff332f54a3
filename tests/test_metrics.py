"""vLLM's metric definitions on hand-made timestamps and step records: exact values."""

from __future__ import annotations

import torch

from minivllm.bench.metrics import (
    LatencyStats,
    RequestResult,
    kv_utilization,
    padding_waste,
    summarize,
)
from minivllm.sequence import RequestMetrics
from minivllm.stats import StepStats


def request(rid, arrival, scheduled, token_times, num_prompt=10) -> RequestResult:
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=token_times[0],
        token_times=list(token_times),
        finished_time=token_times[-1],
    )
    return RequestResult(rid, num_prompt, len(token_times), metrics)


def step(prefill=0, decode=0, padding=0, blocks=0, stored=0) -> StepStats:
    return StepStats(0.0, 1.0, prefill, decode, padding, 1, 0, 0, blocks, stored)


def test_request_latencies_follow_vllm_definitions():
    m = request("a", arrival=1.0, scheduled=1.5, token_times=[3.0, 4.0, 6.0]).metrics
    assert m.queue_time == 0.5
    assert m.ttft == 2.0
    assert m.e2e_latency == 5.0
    assert m.tpot == (5.0 - 2.0) / (3 - 1)
    assert m.inter_token_latencies == [1.0, 2.0]


def test_single_token_request_has_no_tpot():
    m = request("a", 0.0, 0.0, [2.0]).metrics
    assert m.tpot is None
    assert m.inter_token_latencies == []


def test_latency_stats_mean_and_percentiles():
    stats = LatencyStats.of([1.0, 2.0, 3.0, 4.0])
    assert stats.mean == 2.5
    # Nearest rank: each percentile is one of the values, never a point between two.
    assert stats.p50 == 2.0
    assert stats.p90 == 4.0
    assert stats.p99 == 4.0
    bimodal = LatencyStats.of([1.0] * 5 + [9.0] * 5)
    assert bimodal.p50 == 1.0  # interpolation would say 5.0, which nobody waited
    assert LatencyStats.of([]) == LatencyStats(None, None, None, None)


def test_run_summary_throughput_and_latencies():
    requests = [
        request("a", 0.0, 1.0, [2.0, 3.0, 5.0], num_prompt=20),
        request("b", 1.0, 1.0, [4.0], num_prompt=10),
    ]
    s = summarize(requests, duration=10.0)
    assert s.num_requests == 2
    assert s.num_prompt_tokens == 30 and s.num_output_tokens == 4
    assert s.request_throughput == 0.2
    assert s.output_throughput == 0.4
    assert s.total_token_throughput == 3.4
    assert s.queue_time.mean == 0.5  # 1 and 0
    assert s.ttft.mean == 2.5  # 2 and 3
    assert s.tpot.mean == 1.5  # (5 - 2) / 2; b has a single token
    assert s.itl.mean == 1.5  # 1 and 2, all requests' gaps pooled
    assert s.e2e_latency.mean == 4.0  # 5 and 3
    assert s.padding_waste is None  # no step records: not measured


def test_padding_waste_is_padding_over_all_computed_slots():
    steps = [step(prefill=17, padding=10), step(decode=3), step(decode=1, padding=2)]
    assert padding_waste(steps) == 12 / 33


def test_kv_utilization_is_stored_over_reserved_across_steps():
    steps = [step(blocks=4, stored=30), step(blocks=2, stored=18)]
    assert kv_utilization(steps, block_size=8) == 48 / 48
    assert kv_utilization([step(blocks=4, stored=8)], block_size=8) == 0.25


def test_summary_adds_step_totals():
    requests = [request("a", 0.0, 0.0, [1.0, 2.0])]
    steps = [step(prefill=5, padding=3, blocks=2, stored=6), step(decode=1, padding=1, blocks=2)]
    s = summarize(requests, 2.0, steps, block_size=4, num_preemptions=0)
    assert (s.num_steps, s.num_prefill_tokens, s.num_decode_tokens) == (2, 5, 1)
    assert s.num_padding_tokens == 4
    assert s.padding_waste == 4 / 10
    assert s.kv_utilization == 6 / 16
    assert s.max_kv_blocks_used == 2


def test_request_flops_match_the_models_weights(tiny_model_path):
    """One prompt token, one output: every weight matrix is used once (2 flops per
    weight) and attention reads one key and one value per query head per layer."""
    from minivllm import LLM
    from minivllm.models.arithmetic import request_flops

    llm = LLM(model=str(tiny_model_path), num_kv_blocks=4)
    model = llm.llm_engine.executor.model
    config = model.config
    matmul_weights = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear)
    )
    attention = 4 * config.num_heads * config.head_dim * config.num_layers
    assert request_flops(config, 1, 1) == 2 * matmul_weights + attention
    # A second prompt token adds one row of projections and attention over 2 keys.
    rows = 2 * (matmul_weights - config.vocab_size * config.hidden_size)
    assert request_flops(config, 2, 1) - request_flops(config, 1, 1) == rows + 2 * attention
