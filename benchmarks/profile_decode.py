"""Where each millisecond of a decode step goes, per batch size (torch.profiler).

    python benchmarks/profile_decode.py [--batches 1 4 16 32] [--attention-backend auto]
    python benchmarks/profile_decode.py --numba-launch   # serial vs parallel numba kernel
    python benchmarks/profile_decode.py --gemm           # F.linear vs oneDNN-prepacked
    python benchmarks/profile_decode.py --engine         # LLM.generate, both ways in turn
    python benchmarks/profile_decode.py --parts          # attention vs projections vs rest
    python benchmarks/profile_decode.py --prefill        # the same profile, roofline's prefill

Builds the same decode steps as ``benchmarks/roofline.py`` (contexts uniform in 100-500,
seed 0) and profiles a few of them. For each batch size it prints the step's wall time
and the torch ops that took the most of it (self CPU time, summed over the profiled
steps and divided by their number); the attention kernel shows up as
``attention_backend``. What the table does not cover is Python overhead between ops.

``--numba-launch`` instead times the two builds of the numba-cpu kernel (serial and
parallel) on one layer's attention of each decode batch, then whole decode steps with each
(alternating rounds): the numbers behind ``SERIAL_WORK_LIMIT`` in ``kernels/numba_cpu.py``.
``--gemm`` times each of SmolLM2's weight shapes with as many rows as sequences:
``F.linear`` on the row-major weight against the oneDNN-prepacked weight
`minivllm.models.linear.Linear` uses (GB/s of weight read, and GFLOP/s for the prepacked
one). ``--prefill`` profiles roofline.py's 512-token prefill step instead of decodes.
``--engine`` runs `LLM.generate` on 16 seeded prompts (16-300 tokens, 24 greedy output
tokens each), in turn as is and with roofline.py's `unoptimized` switches, twice each, in
one process.
``--parts`` splits a decode step without the profiler's overhead: it times the step
(roofline.py's ``time_step``) as is, with the attention backend returning its query
unchanged, and with every projection but ``lm_head`` returning zeros; the differences are
attention's and the projections' share, and what is left with both stubbed is the rest
(``lm_head``, norms, RoPE, the KV write, the argmax, Python).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
from roofline import (  # noqa: E402
    BLOCK_SIZE,
    PREFILL_PROMPTS,
    build_step,
    decode_contexts,
    empty_kv_caches,
    kv_blocks_for,
    load_smollm2,
)


def wrap_attention(backend) -> None:
    """Label the backend's calls in the profile (the numba kernel is not a torch op)."""
    forward = backend.forward

    def labelled(*args, **kwargs):
        with record_function("attention_backend"):
            return forward(*args, **kwargs)

    backend.forward = labelled


def profile_decode(model, batch: int, steps: int, top: int) -> None:
    contexts = decode_contexts(batch)
    profile_step(model, f"decode {batch} seqs", [1] * batch, contexts, steps, top)


def profile_step(
    model, label: str, query_lens: list[int], contexts: list[int], steps: int, top: int
) -> None:
    """Wall time of one kind of step and the torch ops that took the most of it."""
    num_blocks = kv_blocks_for(contexts, spare_blocks=16)
    kv_caches = empty_kv_caches(model.config, num_blocks)
    input_ids, positions, metadata = build_step(query_lens, contexts, num_blocks)
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
    print(f"\n== {label}: {wall_ms:.1f} ms per step (profiled), ops {listed:.1f} ms")
    print(f"{'op':<40} {'calls':>6} {'self ms':>8} {'total ms':>9}")
    for event in averages[:top]:
        print(
            f"{event.key[:40]:<40} {event.count // steps:6d} "
            f"{event.self_cpu_time_total / 1e3 / steps:8.2f} "
            f"{event.cpu_time_total / 1e3 / steps:9.2f}"
        )


def time_numba_launch(batches: list[int], repeats: int = 200) -> None:
    """Best-of-``repeats`` ms of the serial and the parallel numba kernel, SmolLM2 shapes."""

    import numba
    import numpy as np
    from minivllm_kernels.numba_cpu import paged_attention_kernel, paged_attention_kernel_serial

    num_heads, num_kv_heads, head_dim = 9, 3, 64
    contexts = decode_contexts(max(batches))
    num_blocks = kv_blocks_for(contexts, spare_blocks=16)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape).numpy(), torch.randn(shape).numpy()
    print(f"{'decode':<16} {'serial ms':>10} {'parallel ms':>12}  (best of {repeats})")
    for batch in batches:
        _, _, metadata = build_step([1] * batch, contexts[:batch], num_blocks)
        query = torch.randn(batch, num_heads, head_dim).numpy()
        output = np.empty_like(query)
        common = (query, key_cache, value_cache, metadata.cu_seqlens_q.numpy(),
                  metadata.context_lens.numpy(), metadata.block_tables.numpy(),
                  np.float32(head_dim**-0.5), output)  # fmt: skip
        serial = _best_ms(paged_attention_kernel_serial, common, repeats)
        parallel = _best_ms(paged_attention_kernel, (*common, numba.get_num_threads()), repeats)
        print(f"{batch:>3} sequences    {serial:10.3f} {parallel:12.3f}")


def time_launch_in_step(model, batches: list[int], rounds: int = 10, repeats: int = 5) -> None:
    """Whole decode steps with the serial kernel and with the parallel one on all of numba's
    threads, in alternating rounds of ``repeats`` steps: between torch's ops its OpenMP
    threads spin-wait on the other cores, which the one-layer timing above never sees."""
    from functools import partial

    from roofline import numba_kernel_forced, time_step

    contexts = decode_contexts(max(batches))
    kv_caches = empty_kv_caches(model.config, kv_blocks_for(contexts, spare_blocks=64))
    print(f"\nwhole decode steps, {torch.get_num_threads()} torch threads, "
          f"{rounds} rounds of {repeats}: median (best) ms")  # fmt: skip
    print(f"{'decode':<16} {'serial':>16} {'parallel':>16}")
    for batch in batches:
        samples = [[], []]
        variants = [
            partial(numba_kernel_forced, serial=True),
            partial(numba_kernel_forced, serial=False),
        ]
        for _ in range(rounds):
            steps = time_step(model, kv_caches, [1] * batch, contexts[:batch], repeats, variants)
            for kept, new in zip(samples, steps):
                kept.extend(new)
        cells = [f"{statistics.median(s) * 1e3:7.1f} ({min(s) * 1e3:6.1f})" for s in samples]
        print(f"{batch:>3} sequences    {cells[0]:>16} {cells[1]:>16}")


def time_gemms(batches: list[int], repeats: int = 30) -> None:
    """Best-of-``repeats`` ms and GB/s (weight bytes / time) of each projection shape."""
    import torch.nn.functional as F

    shapes = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
              "down_proj": (576, 1536), "lm_head": (49152, 576)}  # fmt: skip
    print(
        f"{'weight':<14} {'rows':>4} {'F.linear ms':>12} {'GB/s':>6} "
        f"{'prepacked ms':>13} {'GB/s':>6} {'GFLOP/s':>8}"
    )
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        for rows in batches:
            x = torch.randn(rows, in_features)
            plain = _best_ms(F.linear, (x, weight), repeats)
            prepacked = _best_ms(
                torch.ops.mkldnn._linear_pointwise, (x, packed, None, "none", [], ""), repeats
            )
            gigabytes, gigaflops = weight.numel() * 4 / 1e9, 2 * rows * weight.numel() / 1e9
            print(f"{name:<14} {rows:>4} {plain:12.3f} {gigabytes / plain * 1e3:6.1f} "
                  f"{prepacked:13.3f} {gigabytes / prepacked * 1e3:6.1f} "
                  f"{gigaflops / prepacked * 1e3:8.1f}")  # fmt: skip


def time_engine(rounds: int = 2) -> None:
    """Seconds of the same greedy generate, optimized and baseline taking turns."""
    import random

    from roofline import as_is, unoptimized

    from minivllm import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False)  # each round computes its prompts again
    model = llm.llm_engine.executor.model
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(16, 300))]}
        for _ in range(16)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for _ in range(rounds):
        for name, variant in (("optimized", as_is), ("baseline", unoptimized(model))):
            with variant():
                start = time.perf_counter()
                result = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            tokens = [o.outputs[0].token_ids for o in result]
            outputs.setdefault(name, tokens)
            num_tokens = sum(len(t) for t in tokens)
            print(f"{name:<10} {seconds:6.1f} s  {num_tokens / seconds:6.1f} output tok/s")
    same = outputs["optimized"] == outputs["baseline"]
    print(f"greedy tokens identical both ways: {same}")


def time_parts(model, batches: list[int], repeats: int = 5) -> None:
    """ms per decode step: whole, attention, projections (without lm_head), the rest."""
    from contextlib import contextmanager

    from roofline import as_is, step_bytes, time_step

    from minivllm.models.linear import Linear

    backend = model.layers[0].self_attn.backend  # one object, shared by every layer
    projections = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]

    @contextmanager
    def without_attention():
        backend.forward = lambda query, key_cache, value_cache, metadata, scale: query
        try:
            yield
        finally:
            del backend.forward  # back to the class's method

    @contextmanager
    def without_projections():
        for m in projections:
            m.forward = lambda x, m=m: x.new_zeros(x.shape[0], m.out_features)
        try:
            yield
        finally:
            for m in projections:
                del m.forward

    @contextmanager
    def without_both():
        with without_attention(), without_projections():
            yield

    contexts = decode_contexts(max(batches))
    kv_caches = empty_kv_caches(model.config, kv_blocks_for(contexts, spare_blocks=64))
    variants = [as_is, without_attention, without_projections, without_both]
    weights = step_bytes(model, [], [])
    print(f"{'decode':<10} {'step ms':>8} {'attention':>10} {'KV GB/s':>8} "
          f"{'projections':>12} {'rest':>6}")  # fmt: skip
    for batch in batches:
        # Best of three rounds: this machine's speed drifts over seconds, and each part is
        # a difference of two timings.
        rounds = [
            time_step(model, kv_caches, [1] * batch, contexts[:batch], repeats, variants)
            for _ in range(3)
        ]
        # Per variant, its best step over all rounds.
        whole, no_attention, no_projections, rest = (
            min(map(min, samples)) for samples in zip(*rounds)
        )
        attention = whole - no_attention
        kv_bytes = step_bytes(model, [0] * batch, contexts[:batch]) - weights
        print(f"{batch:>3} seqs   {whole * 1e3:8.1f} {attention * 1e3:10.1f} "
              f"{kv_bytes / attention / 1e9:8.1f} {(whole - no_projections) * 1e3:12.1f} "
              f"{rest * 1e3:6.1f}")  # fmt: skip


def _best_ms(kernel, args: tuple, repeats: int) -> float:
    kernel(*args)  # compile / warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per batch size")
    parser.add_argument("--top", type=int, default=15, help="ops listed per batch size")
    parser.add_argument("--numba-launch", action="store_true", help="see the module doc")
    parser.add_argument("--gemm", action="store_true", help="see the module doc")
    parser.add_argument("--engine", action="store_true", help="see the module doc")
    parser.add_argument("--parts", action="store_true", help="see the module doc")
    parser.add_argument("--prefill", action="store_true", help="see the module doc")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gemm:
        time_gemms(args.batches)
        return
    if args.engine:
        time_engine()
        return
    if args.numba_launch:
        time_numba_launch(args.batches)
        time_launch_in_step(load_smollm2("numba-cpu"), args.batches)
        return
    model = load_smollm2(args.attention_backend)
    if args.parts:
        time_parts(model, args.batches)
        return
    wrap_attention(model.layers[0].self_attn.backend)
    if args.prefill:
        prompts = list(PREFILL_PROMPTS)
        profile_step(model, "prefill 512 tokens", prompts, prompts, args.steps, args.top)
        return
    for batch in args.batches:
        profile_decode(model, batch, args.steps, args.top)


if __name__ == "__main__":
    main()
