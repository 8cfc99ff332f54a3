"""Does `torch.compile` make a decode step faster than the eager model? (Measured, not used.)

    python benchmarks/torch_compile.py [--threads 1] [--batches 1 4 16 32]

vLLM compiles its models with `torch.compile` (``enforce_eager=True`` turns that off).
This script measures what it would buy here, on roofline.py's decode steps (contexts
uniform in 100-500, seed 0), best of ``--repeats`` steps each:

- eager, the weights prepacked for oneDNN: how minivllm runs;
- eager with ``F.linear``: what the compiled model starts from, because dynamo cannot
  trace the prepacked oneDNN op (it has no fake-tensor kernel);
- ``torch.compile(dynamic=True)``: one graph for every number of tokens;
- the same with inductor's ``freezing`` (weights as constants, so inductor may prepack them
  itself).

The attention backend stays outside the graph (`torch.compiler.disable`): the numba
kernel is not a torch op. Compile times (first call, then a new batch size) are printed;
the compiled model's hidden states are compared with eager ones. Dynamo's recompile
limit is raised so that no frame falls back to eager: under ``freezing`` each of the 30
layers is its own graph, and one token or several are two graphs (0/1 specialisation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).parent))
from roofline import (  # noqa: E402
    build_step,
    decode_contexts,
    empty_kv_caches,
    kv_blocks_for,
    load_smollm2,
)


def best_step_seconds(forward, kv_caches, batch, contexts, repeats) -> float:
    input_ids, positions, metadata = build_step([1] * batch, contexts[:batch], kv_caches.shape[2])
    best = float("inf")
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # the first one warms up (or compiles)
            start = time.perf_counter()
            forward(input_ids, positions, kv_caches, metadata)
            if repeat:
                best = min(best, time.perf_counter() - start)
    return best


def compile_and_check(model, kv_caches, contexts, freezing: bool):
    """The compiled forward, after timing its first compile and one recompile-free shape."""
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    inductor_config.freezing = freezing
    compiled = torch.compile(model.forward, dynamic=True)
    first = build_step([1] * 4, contexts[:4], kv_caches.shape[2])
    other = build_step([1] * 16, contexts[:16], kv_caches.shape[2])
    with torch.inference_mode():
        eager_hidden = model.forward(*first[:2], kv_caches, first[2])
        start = time.perf_counter()
        hidden = compiled(*first[:2], kv_caches, first[2])
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        compiled(*other[:2], kv_caches, other[2])
        new_shape_seconds = time.perf_counter() - start
    difference = (hidden - eager_hidden).abs().max().item()
    print(
        f"compile (freezing={freezing}): first call {compile_seconds:.1f} s, a new batch size "
        f"{new_shape_seconds:.2f} s; max |hidden - eager hidden| {difference:.1e}"
    )
    return compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=8, help="timed steps per case")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_smollm2("numba-cpu")
    backend = model.layers[0].self_attn.backend  # one backend object, shared by the layers
    backend.forward = torch.compiler.disable(backend.forward)
    contexts = decode_contexts(max(args.batches))
    kv_caches = empty_kv_caches(model.config, kv_blocks_for(contexts, spare_blocks=64))

    def time_all(forward) -> list[float]:
        return [
            best_step_seconds(forward, kv_caches, b, contexts, args.repeats) for b in args.batches
        ]

    rows = {"eager, prepacked (minivllm)": time_all(model.forward)}
    model.process_weights_after_loading(prepack=False)
    rows["eager, F.linear"] = time_all(model.forward)
    rows["compiled"] = time_all(compile_and_check(model, kv_caches, contexts, freezing=False))
    rows["compiled, freezing"] = time_all(compile_and_check(model, kv_caches, contexts, True))

    print(f"\nms per decode step, {args.threads} torch thread(s), best of {args.repeats}")
    print(f"{'':<28}" + "".join(f"{f'{b} seqs':>10}" for b in args.batches))
    for name, seconds in rows.items():
        print(f"{name:<28}" + "".join(f"{s * 1e3:10.1f}" for s in seconds))


if __name__ == "__main__":
    main()
