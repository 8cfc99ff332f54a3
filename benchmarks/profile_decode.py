"""Where each millisecond of a decode step goes, per batch size (torch.profiler).

    python benchmarks/profile_decode.py [--batches 1 4 16 32] [--attention-backend auto]

Builds the same decode steps as ``benchmarks/roofline.py`` (contexts uniform in 100-500,
seed 0) and profiles a few of them. For each batch size it prints the step's wall time
and the torch ops that took the most of it (self CPU time, summed over the profiled
steps and divided by their number); the attention kernel shows up as
``attention_backend``. What the table does not cover is Python overhead between ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from roofline import BLOCK_SIZE, build_step, load_smollm2  # noqa: E402


def wrap_attention(backend) -> None:
    """Label the backend's calls in the profile (the numba kernel is not a torch op)."""
    forward = backend.forward

    def labelled(*args, **kwargs):
        with record_function("attention_backend"):
            return forward(*args, **kwargs)

    backend.forward = labelled


def profile_decode(model, batch: int, steps: int, top: int) -> None:
    import random

    config = model.config
    rng = random.Random(0)
    contexts = [rng.randint(100, 500) for _ in range(batch)]
    num_blocks = sum(-(-c // BLOCK_SIZE) for c in contexts) + 16
    kv_caches = torch.zeros(
        config.num_layers, 2, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim
    )
    input_ids, positions, metadata = build_step([1] * batch, contexts, num_blocks)
    last_rows = (metadata.cu_seqlens_q[1:] - 1).long()

    def step() -> None:
        hidden = model(input_ids, positions, kv_caches, metadata)
        with record_function("compute_logits"):
            model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()

    with torch.inference_mode():
        step(), step()  # warm-up
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    listed = sum(e.self_cpu_time_total for e in averages) / 1e3 / steps
    print(f"\n== decode {batch} seqs: {wall_ms:.1f} ms per step (profiled), ops {listed:.1f} ms")
    print(f"{'op':<40} {'calls':>6} {'self ms':>8} {'total ms':>9}")
    for event in averages[:top]:
        print(
            f"{event.key[:40]:<40} {event.count // steps:6d} "
            f"{event.self_cpu_time_total / 1e3 / steps:8.2f} "
            f"{event.cpu_time_total / 1e3 / steps:9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per batch size")
    parser.add_argument("--top", type=int, default=15, help="ops listed per batch size")
    args = parser.parse_args()
    model = load_smollm2(args.attention_backend)
    wrap_attention(model.layers[0].self_attn.backend)
    for batch in args.batches:
        profile_decode(model, batch, args.steps, args.top)


if __name__ == "__main__":
    main()
