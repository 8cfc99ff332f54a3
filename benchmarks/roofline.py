"""Where an engine step stands against this machine's limits.

    python benchmarks/roofline.py [--attention-backend numba-cpu] [--num-requests 32]

Measures, on the spot, the fp32 matmul peak (GFLOP/s) and how fast the machine reads
memory (GB/s), then runs the bench's synthetic workload (seeded; prompts 16-400 tokens)
and times two kinds of step:

- a *prefill* step (a full 512-token budget of prompt chunks): compute-bound, reported
  as useful GFLOP/s against the matmul peak;
- a *decode* step of the whole batch (one token per sequence): it must read every weight
  and each sequence's keys and values, so it is reported as GB/s against the read speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.bench.metrics import measure_matmul_peak
from minivllm.bench.workloads import LengthDistribution, synthetic


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of summing a buffer far larger than any cache (best of ``repeats``)."""
    buffer = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    EngineConfig.add_cli_args(parser, exclude=("max_num_seqs",))
    args = parser.parse_args()

    peak_gflops, read_gbps = measure_matmul_peak(), measure_read_bandwidth()
    print(
        f"machine: {torch.get_num_threads()} torch threads, fp32 matmul peak "
        f"{peak_gflops:.0f} GFLOP/s, memory read {read_gbps:.1f} GB/s"
    )

    engine = LLMEngine(EngineConfig.from_cli_args(args, max_num_seqs=args.num_requests))
    config = engine.executor.model_config
    vocab = engine.executor.model_config.vocab_size
    workload = synthetic(
        args.num_requests, LengthDistribution.parse("uniform:16:400"),
        LengthDistribution.parse("128"), (10, vocab), seed=0,
    )  # fmt: skip
    for request in workload.requests:
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        engine.add_request(
            request.request_id, {"prompt_token_ids": request.prompt_token_ids}, params
        )

    weight_bytes = sum(p.numel() * p.element_size() for p in engine.executor.model.parameters())
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    prefill, decode = [], []
    while engine.has_unfinished_requests() and len(decode) < 20:
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        step = engine.last_step
        if step.num_prefill_tokens >= 0.9 * engine.config.max_num_batched_tokens:
            flops = sum(
                _chunk_flops(config, s, n)
                for s, n in zip(step.scheduled_seqs, step.num_scheduled_tokens.values())
            )
            prefill.append((seconds, flops))
        elif step.num_decode_tokens == len(step.scheduled_seqs) == args.num_requests:
            context = sum(s.num_computed_tokens for s in step.scheduled_seqs)
            decode.append((seconds, weight_bytes + context * kv_bytes_per_token))

    seconds, flops = _median(prefill)
    budget = engine.config.max_num_batched_tokens
    print(
        f"prefill-heavy step (>= 90% of {budget} tokens): {seconds * 1e3:.0f} ms, "
        f"{flops / seconds / 1e9:.0f} GFLOP/s = {flops / seconds / 1e9 / peak_gflops:.0%} "
        f"of the matmul peak (median of {len(prefill)})"
    )
    seconds, num_bytes = _median(decode)
    print(
        f"decode step, {args.num_requests} sequences: {seconds * 1e3:.0f} ms, reads "
        f"{num_bytes / 1e6:.0f} MB (weights + KV) = {num_bytes / seconds / 1e9:.1f} GB/s = "
        f"{num_bytes / seconds / 1e9 / read_gbps:.0%} of the read speed (median of {len(decode)})"
    )


def _chunk_flops(config, seq, num_new: int) -> int:
    """Useful work of one scheduled chunk, after the step: projections and attention of
    its rows (positions ``start .. start + num_new - 1``), plus the vocabulary projection
    if a token was sampled from it. ``request_flops(n + 1, 0)`` covers positions 0..n-1."""
    end = seq.num_computed_tokens  # the step already advanced the sequence
    rows = config.request_flops(end + 1, 0) - config.request_flops(end - num_new + 1, 0)
    sampled = seq.num_tokens == end + 1
    return rows + (2 * config.hidden_size * config.vocab_size if sampled else 0)


def _median(samples: list[tuple[float, int]]) -> tuple[float, int]:
    if not samples:
        raise SystemExit("no step of that kind ran: use more requests")
    seconds = statistics.median(s for s, _ in samples)
    return seconds, statistics.median(v for _, v in samples)


if __name__ == "__main__":
    main()
