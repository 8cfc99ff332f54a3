"""Where one decode step's CPU time goes at one sequence: the matmuls, or the rest.

Runs the model's forward and LM head for one decode token (context 100) per format, then
again with every `Linear` replaced by a no-op that returns zeros of the right shape: the
difference is the matmuls, what is left is the rest of the model (norms, rotary embedding,
attention, KV-cache writes, the ops' dispatch). CPU time (``time.process_time``), the
median of ``--repeats`` rounds of 20 steps each, one thread.

    OMP_NUM_THREADS=1 python benchmarks/step_split.py --formats none,int8,gguf

Before/after a change to the model: run it from both checkouts in turn
(``PYTHONPATH=<old worktree> python benchmarks/step_split.py``), several times each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.attention import AttentionMetadata
from minivllm.config import EngineConfig
from minivllm.executor import UniProcExecutor
from minivllm.models.linear import Linear


def median_ms(step, repeats: int, steps: int = 20) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(steps):
            step()
        times.append((time.process_time() - start) / steps * 1e3)
    return statistics.median(times)


def split(quantization: str | None, repeats: int) -> tuple[float, float]:
    executor = UniProcExecutor(EngineConfig(quantization=quantization, num_kv_blocks=16))
    model, kv_caches = executor.model, executor.model_runner.kv_caches
    context = 100
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([context - 1]),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        context_lens=torch.tensor([context], dtype=torch.int32),
        block_tables=torch.arange(7, dtype=torch.int32)[None],
        max_query_len=1,
        max_context_len=context,
    )
    token, position = torch.tensor([500]), torch.tensor([context - 1])

    def step():
        with torch.inference_mode():
            return model.compute_logits(model(token, position, kv_caches, metadata))

    whole = median_ms(step, repeats)
    forward = Linear.forward
    Linear.forward = lambda self, x: x.new_zeros(*x.shape[:-1], self.out_features)
    try:
        rest = median_ms(step, repeats)
    finally:
        Linear.forward = forward
    return whole, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="none,int8,gguf", help="comma list; none = fp32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| format | step CPU ms | matmuls | the rest of the model |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.formats.split(","):
        whole, rest = split(None if name == "none" else name, args.repeats)
        label = "fp32" if name == "none" else name
        print(f"| {label} | {whole:.2f} | {whole - rest:.2f} | {rest:.2f} |", flush=True)


if __name__ == "__main__":
    main()
