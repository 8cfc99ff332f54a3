"""GGUF's Q4_1 and Q8_0 blocks times activations, as a numba CPU kernel.

llama.cpp stores a weight matrix row by row, each row cut into blocks of 32 weights:

- **Q4_1**: per block a scale ``d`` and a minimum ``m`` (two fp16 numbers in the file) and
  32 unsigned 4-bit values ``q`` packed two per byte, 16 bytes: weight ``j`` of the block
  is ``d * q[j] + m``. Byte ``i`` holds weight ``i`` in its low nibble and weight
  ``i + 16`` in its high one. 20 bytes per 32 weights in the file.
- **Q8_0**: per block a scale ``d`` and 32 signed bytes: weight ``j`` is ``d * q[j]``.
  34 bytes per 32 weights.

minivllm keeps those numbers as they are, one array each (`minivllm.quantization.gguf`):
``qs`` the packed values, ``d`` (and ``m``) widened from fp16 to fp32 once at load,
because numba cannot compute in fp16 on a CPU. ``d * q`` is exact in fp32 (an fp16 scale
has 11 significant bits, ``q`` at most 8), so ``d * q + m`` is exactly the fp32 weight the
dequantized checkpoint holds, whatever order the hardware rounds in.

The kernel, read top to bottom: for each output feature (a weight row) and each
activation row, walk the blocks; in a block, multiply the 32 stored integers by the 32
inputs and sum (``dot``), then scale once: ``d * dot + m * sum(x)``, which is
``sum((d q + m) x)`` regrouped (llama.cpp's regrouping too). ``sum(x)`` per block is the
same for every weight row, so it is computed once per call. The weights are exactly the
dequantized checkpoint's; only the order of the additions differs from an fp32 GEMM, so
outputs agree to fp32 rounding (tests/test_quantization.py). The point is the bytes: a
Q4_1 weight is 5/8 of a byte in memory plus its share of the scales, not 4 bytes.

How fast it is, measured (docs/tutorial/quantization.md): slower than oneDNN's fp32 GEMV
on the development machine, because numba/LLVM turns the byte -> float conversion into
scalar instructions (``cvtsi2ss``, no ``vcvtdq2ps`` in ``inspect_asm``): the loop is
bound by instructions, not by the bytes it saves. A fast kernel would convert 8 or 16
values per instruction (llama.cpp's hand-written SIMD); this one is for reading.

Serial and parallel versions share the loop body; the parallel one splits output features
across numba's threads (``prange``), which write disjoint outputs, so no locks.
"""

from __future__ import annotations

import os

try:
    import numba
    import numpy as np
    from numba import njit, prange
except ImportError as error:
    raise ImportError("the gguf kernels need numba: pip install minivllm[kernels]") from error

if "NUMBA_THREADING_LAYER" not in os.environ:  # as in numba_cpu.py: beside torch's OpenMP
    numba.config.THREADING_LAYER = "workqueue"

BLOCK = 32  # weights per block, both formats
LOW_NIBBLE = np.int32(0xF)


@njit(inline="always", fastmath=True)
def _q4_1_row(qs, d, m, n, x, x_sums, y):
    """y[:, n] = x @ (weight row n). Per block, with q the 32 stored values:
    sum_j (d q_j + m) x_j  =  d * sum_j q_j x_j  +  m * sum_j x_j,
    and sum_j x_j (``x_sums``) is the same for every row, so it is computed once per call."""
    num_rows, num_blocks = x.shape[0], d.shape[1]
    half = BLOCK // 2
    for r in range(num_rows):
        acc = np.float32(0.0)
        for b in range(num_blocks):
            dot = np.float32(0.0)  # sum_j q_j x_j over the block
            for i in range(half):
                byte = np.int32(qs[n, b * half + i])
                low, high = byte & LOW_NIBBLE, byte >> 4  # weights i and i + 16
                dot += np.float32(low) * x[r, b * BLOCK + i]
                dot += np.float32(high) * x[r, b * BLOCK + half + i]
            acc += d[n, b] * dot + m[n, b] * x_sums[r, b]
        y[r, n] = acc


@njit(inline="always", fastmath=True)
def _q8_0_row(qs, d, n, x, y):
    """y[:, n] = x @ (weight row n): per block, d * sum_j q_j x_j."""
    num_rows, num_blocks = x.shape[0], d.shape[1]
    for r in range(num_rows):
        acc = np.float32(0.0)
        for b in range(num_blocks):
            dot = np.float32(0.0)
            for j in range(BLOCK):
                dot += np.float32(qs[n, b * BLOCK + j]) * x[r, b * BLOCK + j]
            acc += d[n, b] * dot
        y[r, n] = acc


@njit(fastmath=True, cache=True)
def q4_1_matmul_serial(qs, d, m, x, x_sums, y):
    """``y = x @ W.T`` for a Q4_1 matrix ``W`` (``qs`` uint8 ``[N, K // 2]``, ``d``/``m``
    fp32 ``[N, K // 32]``), ``x`` fp32 ``[M, K]``, ``y`` fp32 ``[M, N]``; on this thread."""
    for n in range(qs.shape[0]):
        _q4_1_row(qs, d, m, n, x, x_sums, y)


@njit(fastmath=True, parallel=True, cache=True)
def q4_1_matmul_parallel(qs, d, m, x, x_sums, y):
    """`q4_1_matmul_serial`, output features split across numba's threads."""
    for n in prange(qs.shape[0]):
        _q4_1_row(qs, d, m, n, x, x_sums, y)


@njit(fastmath=True, cache=True)
def q8_0_matmul_serial(qs, d, x, y):
    """``y = x @ W.T`` for a Q8_0 matrix ``W`` (``qs`` int8 ``[N, K]``, ``d`` fp32
    ``[N, K // 32]``); on this thread."""
    for n in range(qs.shape[0]):
        _q8_0_row(qs, d, n, x, y)


@njit(fastmath=True, parallel=True, cache=True)
def q8_0_matmul_parallel(qs, d, x, y):
    """`q8_0_matmul_serial`, output features split across numba's threads."""
    for n in prange(qs.shape[0]):
        _q8_0_row(qs, d, n, x, y)


def q4_1_matmul(qs, d, m, x, threads: int = 1) -> np.ndarray:
    """``x @ W.T`` for Q4_1 ``W``: a new fp32 ``[M, N]`` array."""
    y = np.empty((x.shape[0], qs.shape[0]), dtype=np.float32)
    x_sums = x.reshape(x.shape[0], -1, BLOCK).sum(axis=2)  # [M, K // 32]
    if threads > 1:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        q4_1_matmul_parallel(qs, d, m, x, x_sums, y)
    else:
        q4_1_matmul_serial(qs, d, m, x, x_sums, y)
    return y


def q8_0_matmul(qs, d, x, threads: int = 1) -> np.ndarray:
    """``x @ W.T`` for Q8_0 ``W``: a new fp32 ``[M, N]`` array."""
    y = np.empty((x.shape[0], qs.shape[0]), dtype=np.float32)
    if threads > 1:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        q8_0_matmul_parallel(qs, d, x, y)
    else:
        q8_0_matmul_serial(qs, d, x, y)
    return y


__all__ = ["BLOCK", "q4_1_matmul", "q8_0_matmul"]
