"""The GGUF matmul on the bundled model's own matrices, against oneDNN's fp32 GEMM.

For layer 0's MLP up projection (Q4_1, ``[576 -> 1536]``) and the LM head (Q8_0,
``[576 -> 49152]``), at 1, 4 and 32 activation rows: milliseconds per call of
`GGUFLinearMethod` (the numba kernel up to 4 rows, dequantized slices and torch's GEMM
beyond) and of the fp32 `Linear` holding the same numbers, prepacked for oneDNN. Best of
``--repeats`` rounds, one thread; the largest difference of the two outputs too.

    OMP_NUM_THREADS=1 python benchmarks/gguf_kernel.py
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.models.linear import Linear
from minivllm.models.model_files import find_gguf
from minivllm.quantization.gguf import GGUFLinearMethod, split_q4_1, split_q8_0

MATRICES = {"blk.0.ffn_up.weight": "MLP up, Q4_1", "token_embd.weight": "LM head, Q8_0"}


def best_ms(call, repeats: int, calls: int = 10) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def layers(tensor) -> tuple[Linear, Linear]:
    """The GGUF layer and the fp32 one holding the same numbers."""
    kind = tensor.tensor_type.name
    parts = (split_q4_1 if kind == "Q4_1" else split_q8_0)(tensor.data)
    rows, columns = parts["d"].shape[0], parts["d"].shape[1] * 32
    quantized = Linear(columns, rows, bias=False)
    quantized.quant_method = method = GGUFLinearMethod()
    method.set_blocks(quantized, kind, parts)
    quantized.process_weights_after_loading()
    dense = Linear(columns, rows, bias=False)
    with torch.no_grad():
        dense.weight.copy_(method.dequantize(quantized))
    dense.process_weights_after_loading()
    return quantized, dense


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = {t.name: t for t in gguf.GGUFReader(find_gguf()).tensors}
    print("| matrix | rows | gguf ms | fp32 (oneDNN) ms | largest difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, label in MATRICES.items():
        quantized, dense = layers(tensors[name])
        for num_rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(num_rows, quantized.in_features)
            with torch.inference_mode():
                gap = (quantized(x) - dense(x)).abs().max().item()
                q_ms = best_ms(lambda q=quantized, x=x: q(x), args.repeats)
                d_ms = best_ms(lambda d=dense, x=x: d(x), args.repeats)
            print(f"| {label} | {num_rows} | {q_ms:.3f} | {d_ms:.3f} | {gap:.1e} |", flush=True)


if __name__ == "__main__":
    main()
