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
activation row, one loop over the row's stored values, each multiplied by its input and
by its block's scale ``d``; for Q4_1 the minimums come last, ``m * sum(x)`` per block,
which is ``sum((d q + m) x)`` regrouped (llama.cpp regroups the same way). The sums of x
per block are the same for every weight row, so they are computed once per call, and the
inputs are reordered once per call to match the nibble order (`split_nibble_inputs`).
The weights are exactly the dequantized checkpoint's; only the order of the additions
differs from an fp32 GEMM, so outputs agree to fp32 rounding (tests/test_quantization.py).

Why one long loop per row and not a loop per block: LLVM vectorizes a loop of 288 bytes
(16 at a time on AVX-512) but left the 16-iteration block loops scalar, one ``cvtsi2ss``
per nibble (``inspect_asm``): written block by block, the same kernel was several times
slower than written as below (docs/tutorial/quantization.md has the measurements). Each
weight byte is read once per activation row; at one sequence that is once per step, and
the step is bound by bytes: a Q4_1 weight is 5/8 of a byte plus its share of the scales,
not the 4 bytes of fp32.
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
LOW_NIBBLE = np.uint8(0xF)


@njit(inline="always", fastmath=True)
def _q4_1_row(qs, d, m, n, x_low, x_high, x_sums, y):
    """y[:, n] = x @ (weight row n of a Q4_1 matrix).

    Byte ``k`` of the row (block ``k // 16``) holds two weights: its low nibble is the
    block's weight ``k % 16``, its high nibble weight ``k % 16 + 16``; ``x_low[k]`` and
    ``x_high[k]`` are the inputs those two weights multiply. Per block,
    sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j."""
    row, scales, minimums = qs[n], d[n], m[n]
    for r in range(x_low.shape[0]):
        xl, xh = x_low[r], x_high[r]
        acc = np.float32(0.0)
        for k in range(row.shape[0]):  # one long loop over the row's bytes: LLVM vectorizes it
            low, high = row[k] & LOW_NIBBLE, row[k] >> 4
            acc += scales[k >> 4] * (np.float32(low) * xl[k] + np.float32(high) * xh[k])
        for b in range(scales.shape[0]):  # the minimums: m * sum(x), block by block
            acc += minimums[b] * x_sums[r, b]
        y[r, n] = acc


@njit(inline="always", fastmath=True)
def _q8_0_row(qs, d, n, x, y):
    """y[:, n] = x @ (weight row n of a Q8_0 matrix): per block, d * sum_j q_j x_j."""
    row, scales = qs[n], d[n]
    for r in range(x.shape[0]):
        xr = x[r]
        acc = np.float32(0.0)
        for k in range(row.shape[0]):  # one long loop over the row (k >> 5: its block)
            acc += scales[k >> 5] * (np.float32(row[k]) * xr[k])
        y[r, n] = acc


@njit(fastmath=True, cache=True)
def q4_1_matmul_serial(qs, d, m, x_low, x_high, x_sums, y):
    """``y = x @ W.T`` for a Q4_1 matrix ``W`` (``qs`` uint8 ``[N, K // 2]``, ``d``/``m``
    fp32 ``[N, K // 32]``; ``x`` given as `split_nibble_inputs`), ``y`` fp32 ``[M, N]``;
    on this thread."""
    for n in range(qs.shape[0]):
        _q4_1_row(qs, d, m, n, x_low, x_high, x_sums, y)


@njit(fastmath=True, parallel=True, cache=True)
def q4_1_matmul_parallel(qs, d, m, x_low, x_high, x_sums, y):
    """`q4_1_matmul_serial`, output features split across numba's threads."""
    for n in prange(qs.shape[0]):
        _q4_1_row(qs, d, m, n, x_low, x_high, x_sums, y)


@njit(fastmath=True, cache=True)
def q8_0_matmul_serial(qs, d, x, y):
    """``y = x @ W.T`` for a Q8_0 matrix ``W`` (``qs`` int8 ``[N, K]``, ``d`` fp32
    ``[N, K // 32]``), ``x`` fp32 ``[M, K]``; on this thread."""
    for n in range(qs.shape[0]):
        _q8_0_row(qs, d, n, x, y)


@njit(fastmath=True, parallel=True, cache=True)
def q8_0_matmul_parallel(qs, d, x, y):
    """`q8_0_matmul_serial`, output features split across numba's threads."""
    for n in prange(qs.shape[0]):
        _q8_0_row(qs, d, n, x, y)


@njit(fastmath=True, cache=True)
def q4_1_dequantize_nibble_order(qs, d, m, out):
    """The fp32 weights ``d * q + m`` of a Q4_1 matrix into ``out`` ``[N, K]``, each row as
    its low nibbles' weights then its high nibbles' (`split_nibble_inputs`' order), so
    that ``[x_low, x_high] @ out.T`` is ``x @ W.T``. Flat loops, as in the kernel."""
    half = qs.shape[1]
    for n in range(qs.shape[0]):
        row, scales, minimums = qs[n], d[n], m[n]
        low, high = out[n, :half], out[n, half:]
        for k in range(half):
            low[k] = scales[k >> 4] * np.float32(row[k] & LOW_NIBBLE) + minimums[k >> 4]
            high[k] = scales[k >> 4] * np.float32(row[k] >> 4) + minimums[k >> 4]


@njit(fastmath=True, cache=True)
def q8_0_dequantize(qs, d, out):
    """The fp32 weights ``d * q`` of a Q8_0 matrix into ``out`` ``[N, K]``."""
    for n in range(qs.shape[0]):
        row, scales, weights = qs[n], d[n], out[n]
        for k in range(row.shape[0]):
            weights[k] = scales[k >> 5] * np.float32(row[k])


def split_nibble_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` ``[M, K]`` as the Q4_1 kernel reads it: ``x_low[:, k]`` and ``x_high[:, k]``
    are the inputs of byte ``k``'s low and high nibble (weights ``k % 16`` and
    ``k % 16 + 16`` of block ``k // 16``), ``x_sums`` each block's sum ``[M, K // 32]``."""
    blocks = x.reshape(x.shape[0], -1, 2, BLOCK // 2)  # [M, block, low/high half, 16]
    x_low = np.ascontiguousarray(blocks[:, :, 0]).reshape(x.shape[0], -1)
    x_high = np.ascontiguousarray(blocks[:, :, 1]).reshape(x.shape[0], -1)
    return x_low, x_high, blocks.sum(axis=(2, 3), dtype=np.float32)


def q4_1_matmul(qs, d, m, x, threads: int = 1) -> np.ndarray:
    """``x @ W.T`` for Q4_1 ``W``: a new fp32 ``[M, N]`` array."""
    y = np.empty((x.shape[0], qs.shape[0]), dtype=np.float32)
    inputs = split_nibble_inputs(x)
    if threads > 1:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        q4_1_matmul_parallel(qs, d, m, *inputs, y)
    else:
        q4_1_matmul_serial(qs, d, m, *inputs, y)
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


__all__ = [
    "BLOCK",
    "q4_1_dequantize_nibble_order",
    "q4_1_matmul",
    "q8_0_dequantize",
    "q8_0_matmul",
    "split_nibble_inputs",
]
