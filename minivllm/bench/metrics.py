"""Benchmark metrics, with vLLM's definitions, per request and per run.

Per request (from `RequestMetrics`' timestamps): queue time (arrival -> first scheduled),
TTFT (arrival -> first output token), TPOT = (e2e - TTFT) / (output tokens - 1), the
inter-token latencies (ITL) and the end-to-end latency (arrival -> last token).

Per run (`RunSummary`): token and request throughput, mean / P50 / P90 / P99 of each
latency, padding waste, KV-cache utilisation, preemptions, prefix-cache hit rate, built
from the engine's per-step `StepStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minivllm.sequence import RequestMetrics
from minivllm.stats import StepStats

PERCENTILES = (50, 90, 99)
# Nearest rank: every percentile is a latency some request (or token) really had. numpy's
# default (and vLLM's) interpolates, which can report a P50 halfway between two groups of
# requests that nobody experienced.
PERCENTILE_METHOD = "inverted_cdf"


@dataclass
class RequestResult:
    """One finished request as the benchmark sees it."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics


@dataclass
class LatencyStats:
    """Mean and nearest-rank percentiles of one latency over a run, in seconds (None: no
    samples)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        if not values:
            return cls(None, None, None, None)
        p50, p90, p99 = (
            float(v) for v in np.percentile(values, PERCENTILES, method=PERCENTILE_METHOD)
        )
        return cls(float(np.mean(values)), p50, p90, p99)


@dataclass
class RunSummary:
    """Everything one benchmark run reports. Latencies in seconds; None = not measured."""

    num_requests: int
    duration: float
    num_prompt_tokens: int
    num_output_tokens: int
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    queue_time: LatencyStats
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e_latency: LatencyStats
    num_steps: int | None = None
    num_prefill_tokens: int | None = None
    num_decode_tokens: int | None = None
    num_padding_tokens: int | None = None
    padding_waste: float | None = None  # padding / all computed token slots
    kv_utilization: float | None = None  # tokens stored / slots reserved, over all steps
    max_kv_blocks_used: int | None = None
    mean_batch_size: float | None = None  # real sequences per step
    max_batch_size: int | None = None  # the most real sequences in one step
    num_preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None
    model_flops: float | None = None  # the useful work: `arithmetic.request_flops`, summed

    @property
    def model_gflops_per_s(self) -> float | None:
        """Useful work per second: how close the run came to the machine's matmul peak."""
        return None if self.model_flops is None else self.model_flops / self.duration / 1e9


def summarize(
    requests: list[RequestResult],
    duration: float,
    steps: list[StepStats] | None = None,
    block_size: int | None = None,
    num_preemptions: int | None = None,
    prefix_cache_hit_rate: float | None = None,
) -> RunSummary:
    """The run's numbers. ``steps`` (and ``block_size``, for KV utilisation) come from
    minivllm runs; the transformers baselines have only the per-request timestamps."""
    metrics = [r.metrics for r in requests]
    num_prompt = sum(r.num_prompt_tokens for r in requests)
    num_output = sum(r.num_output_tokens for r in requests)
    summary = RunSummary(
        num_requests=len(requests),
        duration=duration,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        request_throughput=len(requests) / duration,
        output_throughput=num_output / duration,
        total_token_throughput=(num_prompt + num_output) / duration,
        queue_time=LatencyStats.of(_present(m.queue_time for m in metrics)),
        ttft=LatencyStats.of(_present(m.ttft for m in metrics)),
        tpot=LatencyStats.of(_present(m.tpot for m in metrics)),
        itl=LatencyStats.of([itl for m in metrics for itl in m.inter_token_latencies]),
        e2e_latency=LatencyStats.of(_present(m.e2e_latency for m in metrics)),
        num_preemptions=num_preemptions,
        prefix_cache_hit_rate=prefix_cache_hit_rate,
    )
    if steps:
        _add_step_totals(summary, steps, block_size)
    return summary


def _add_step_totals(summary: RunSummary, steps: list[StepStats], block_size: int | None) -> None:
    summary.num_steps = len(steps)
    summary.num_prefill_tokens = sum(s.num_prefill_tokens for s in steps)
    summary.num_decode_tokens = sum(s.num_decode_tokens for s in steps)
    summary.num_padding_tokens = sum(s.num_padding_tokens for s in steps)
    summary.padding_waste = padding_waste(steps)
    summary.max_kv_blocks_used = max(s.num_kv_blocks_used for s in steps)
    batch_sizes = [len(s.prefill_ids) + len(s.decode_ids) for s in steps]
    summary.mean_batch_size = float(np.mean(batch_sizes))
    summary.max_batch_size = max(batch_sizes)
    if block_size is not None:
        summary.kv_utilization = kv_utilization(steps, block_size)


def padding_waste(steps: list[StepStats]) -> float:
    """Fraction of all token rows the model computed that were padding."""
    computed = sum(s.num_computed_slots for s in steps)
    return sum(s.num_padding_tokens for s in steps) / computed if computed else 0.0


def kv_utilization(steps: list[StepStats], block_size: int) -> float:
    """Real tokens stored / KV slots reserved, summed over steps (each step weighs the
    same). 1.0 means no reserved slot sat empty. With prefix caching a shared block holds
    tokens of several requests, so this can exceed 1."""
    reserved = sum(s.num_kv_blocks_used for s in steps) * block_size
    return sum(s.num_kv_tokens_stored for s in steps) / reserved if reserved else 0.0


def _present(values) -> list[float]:
    return [v for v in values if v is not None]
