"""Time the CPU attention backends on the batches an engine step really sees.

    python benchmarks/attention.py [--repeats 50]

Prints the time per call of the torch reference and numba-cpu on
- a decode batch: 32 sequences, SmolLM2-135M's heads (9 query / 3 kv, head_dim 64),
  contexts 100-500, block size 16;
- a prefill chunk: one 400-token prompt;
- a mixed step: that prompt's last 128 tokens next to the 32 decodes;
with the memory traffic and arithmetic each call needs, as GB/s and GFLOP/s next to this
machine's limits, measured on the spot as benchmarks/roofline.py does: how fast it reads
a buffer far larger than its caches, and its fp32 matmul peak.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from minivllm_kernels.random_batch import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, random_paged_step

from minivllm.attention import get_backend
from minivllm.bench.hardware_probe import measure_matmul_peak, measure_read_bandwidth


def work(context_lens: list[int], query_lens: list[int]) -> tuple[float, float]:
    """(bytes, flops) one call needs: each sequence's K and V read once (GQA shares them
    across a group), 4 flops per (query head, visible key, dim) for q.k and p.v."""
    kv_bytes = sum(context_lens) * NUM_KV_HEADS * HEAD_DIM * 4 * 2
    qo_bytes = sum(query_lens) * NUM_HEADS * HEAD_DIM * 4 * 2
    visible_keys = sum(
        sum(range(c - q + 1, c + 1)) for c, q in zip(context_lens, query_lens)
    )  # row at position p sees p + 1 keys
    return kv_bytes + qo_bytes, 4.0 * visible_keys * NUM_HEADS * HEAD_DIM


def time_calls(backend, step, repeats: int) -> list[float]:
    query, key_cache, value_cache, metadata = step
    scale = HEAD_DIM**-0.5
    backend.forward(query, key_cache, value_cache, metadata, scale)  # compile, warm caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.forward(query, key_cache, value_cache, metadata, scale)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    decode_contexts = torch.randint(100, 501, (32,), generator=generator).tolist()
    cases = {
        "decode 32 seqs, ctx 100-500": (decode_contexts, [1] * 32),
        "prefill chunk, 400 tokens": ([400], [400]),
        "mixed: 128-token chunk + 32 decodes": ([400, *decode_contexts], [128] + [1] * 32),
    }
    backends = {name: get_backend(name)() for name in ("torch", "numba-cpu")}
    import numba  # imported by the numba-cpu backend above

    # One tiny call starts numba's thread pool, so threading_layer() can name the layer.
    backends["numba-cpu"].forward(*random_paged_step([1], [1]), HEAD_DIM**-0.5)
    read_gbps, peak_gflops = measure_read_bandwidth() / 1e9, measure_matmul_peak()
    print(
        f"torch threads {torch.get_num_threads()}, numba threads {numba.get_num_threads()} "
        f"(layer {numba.threading_layer()}); "
        f"limits measured now: {read_gbps:.1f} GB/s read, {peak_gflops:.0f} GFLOP/s fp32 matmul"
    )
    print(
        f"{'case':38} {'backend':10} {'median ms':>9} {'best ms':>8} {'p90 ms':>7}"
        f" {'GB/s':>6} {'% read':>6} {'GFLOP/s':>8} {'% peak':>6}"
    )
    for case, (context_lens, query_lens) in cases.items():
        step = random_paged_step(context_lens, query_lens)
        num_bytes, flops = work(context_lens, query_lens)
        for name, backend in backends.items():
            times = sorted(time_calls(backend, step, args.repeats))
            median = statistics.median(times)
            p90 = times[int(0.9 * (len(times) - 1))]
            gbps, gflops = num_bytes / median / 1e9, flops / median / 1e9
            print(
                f"{case:38} {name:10} {median * 1e3:9.2f} {times[0] * 1e3:8.2f} "
                f"{p90 * 1e3:7.2f} {gbps:6.1f} {gbps / read_gbps:6.0%} "
                f"{gflops:8.1f} {gflops / peak_gflops:6.0%}"
            )


if __name__ == "__main__":
    main()
