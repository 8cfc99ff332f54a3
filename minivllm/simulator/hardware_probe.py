"""How fast this machine multiplies matrices and reads memory, measured now: the two
rates of a roofline. `hardware.measure_this_cpu` turns them into a `Hardware` preset for
the simulator; the bench records the matmul peak beside its runs, and the benchmark
scripts draw their rooflines from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def matmul_candidates(size: int = 1024) -> dict[str, Callable[[], torch.Tensor]]:
    """The fp32 GEMMs this machine can run a ``size``-square product with, as no-argument
    calls: ``torch.mm`` and the model's own `Linear` (prepacked for oneDNN where this
    torch build can). The faster one is the peak: on an AMD CPU, MKL's ``torch.mm`` can
    take a slower code path than oneDNN (on the development box 100 against 220 GFLOP/s
    on one thread), and a roofline drawn from the slower one lets prefill look faster
    than the peak."""
    from minivllm.models.linear import Linear

    a, b = torch.randn(size, size), torch.randn(size, size)
    layer = Linear(size, size, bias=False)
    layer.process_weights_after_loading()
    return {"torch.mm": lambda: torch.mm(a, b), "Linear": lambda: layer(a)}


def measure_matmul_peak(size: int = 1024, seconds: float = 1.0) -> float:
    """This machine's fp32 matrix-multiply speed right now, in GFLOP/s, with torch's
    current thread count: the roofline that no step of the model can beat. The faster of
    `matmul_candidates`, each timed for half of ``seconds``."""
    best = 0.0
    with torch.inference_mode():
        for gemm in matmul_candidates(size).values():
            gemm()  # warm-up
            num_calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 2:
                gemm()
                num_calls += 1
            best = max(best, 2 * size**3 * num_calls / elapsed / 1e9)
    return best


def measure_read_bandwidth(num_bytes: int = 256 << 20, seconds: float = 0.5) -> float:
    """Bytes/s a reduction reads from memory (a tensor far larger than the caches)."""
    x = torch.ones(num_bytes // 4)
    x.sum()  # warm-up
    num_calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        x.sum()
        num_calls += 1
    return num_bytes * num_calls / elapsed
