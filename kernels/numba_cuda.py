"""Paged attention as one numba.cuda kernel, for a GPU or for numba's CUDA simulator.

One CUDA block computes one (query row, head) pair of the flattened mixed batch, so
prefill chunks and decodes share a launch. The block walks its sequence's context in
tiles of ``threads`` keys:

1. each thread scores one key of the tile (a dot product with the query, read straight
   from the paged cache through the block table) and writes it to shared memory;
2. every thread reads the whole tile's scores, so all threads agree on the running max
   without a reduction step, and turns its own key's score into a softmax weight;
3. each thread owns a few of the ``head_dim`` output dimensions and adds the tile's
   weighted values into them (and every thread sums the same denominator).

The running max/denominator (online softmax) means the context length is unbounded and
no score matrix is ever stored. Accumulation is float32 for float32 and float16 inputs.

The same source runs on a real GPU (torch CUDA tensors are passed zero-copy, and the
kernel is launched on torch's current stream) and, with NUMBA_ENABLE_CUDASIM=1, in the
simulator on CPU tensors, which is how the tests run it without a GPU.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import numpy as np
    from numba import cuda, float32
except ImportError as error:  # tests/test_attention_registry.py hides numba to check this
    raise ImportError(
        "the numba attention backends need numba and numba-cuda: pip install minivllm[kernels]"
    ) from error

from minivllm.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.utils import cdiv


def simulator_enabled() -> bool:
    """True when numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM=1 at import)."""
    try:
        from numba.cuda.core import config  # numba-cuda
    except ImportError:  # the CUDA target that older numba versions bundled
        from numba.core import config
    return bool(config.ENABLE_CUDASIM)


def _serialize_simulator_shared_arrays() -> None:
    """Fix a race in numba-cuda's simulator (0.30): ``cuda.shared.array`` looks up the
    array for its source line, and creates it if missing, without a lock. Two simulated
    threads reaching the line at once can each create their own "shared" array and never
    see each other's writes; this kernel then returned a wrong row about once in a hundred
    launches. A real GPU has no such race. Same lookup, made atomic."""
    import sys
    import threading

    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic / aligned: not used here
            raise NotImplementedError("minivllm's simulator patch covers static arrays only")
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    FakeCUDAShared.array = array


if simulator_enabled():
    _serialize_simulator_shared_arrays()

# The simulator runs every CUDA thread as a Python thread: few threads keep it fast.
DEFAULT_THREADS = 4 if simulator_enabled() else 64


@cuda.jit(device=True)
def sequence_of_row(cu_seqlens_q, row):
    """The sequence owning flattened query row ``row``: the last ``i`` with start <= row."""
    low, high = 0, cu_seqlens_q.shape[0] - 2
    while low < high:
        middle = (low + high + 1) // 2
        if cu_seqlens_q[middle] <= row:
            low = middle
        else:
            high = middle - 1
    return low


@functools.cache
def build_kernel(threads: int, dims_per_thread: int):
    """The kernel for ``threads`` threads per block, each owning ``dims_per_thread`` dims.

    Both are baked in as compile-time constants: shared and local array sizes must be.
    Launch with grid ``(num_tokens, num_heads)`` and ``threads`` threads per block.
    """
    max_head_dim = threads * dims_per_thread

    @cuda.jit
    def paged_attention_kernel(
        query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, scale, output
    ):
        """query, output: ``[num_tokens, num_heads, head_dim]`` (fp32 or fp16).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        cu_seqlens_q, context_lens, block_tables: int32 (see `AttentionMetadata`).
        scale: float32."""
        row, head, thread = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        head_dim, block_size = query.shape[2], key_cache.shape[1]
        kv_head = head // (query.shape[1] // key_cache.shape[2])
        seq = sequence_of_row(cu_seqlens_q, row)
        query_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
        # This row is at position context_len - query_len + (row - first row of seq).
        num_keys = context_lens[seq] - query_len + (row - cu_seqlens_q[seq]) + 1

        scaled_query = cuda.shared.array(max_head_dim, float32)
        scores = cuda.shared.array(threads, float32)
        weights = cuda.shared.array(threads, float32)
        for d in range(thread, head_dim, threads):
            scaled_query[d] = float32(query[row, head, d]) * scale
        weighted_sum = cuda.local.array(dims_per_thread, float32)
        for i in range(dims_per_thread):
            weighted_sum[i] = float32(0.0)
        running_max = float32(-math.inf)
        denominator = float32(0.0)
        cuda.syncthreads()

        for tile_start in range(0, num_keys, threads):
            keys_in_tile = min(threads, num_keys - tile_start)
            # 1. Thread t scores key tile_start + t, read from the cache via the block table.
            if thread < keys_in_tile:
                key = tile_start + thread
                block = block_tables[seq, key // block_size]
                offset = key % block_size
                score = float32(0.0)
                for d in range(head_dim):
                    score += scaled_query[d] * float32(key_cache[block, offset, kv_head, d])
                scores[thread] = score
            cuda.syncthreads()

            # 2. Every thread reads every score (a broadcast read of shared memory), so all
            #    agree on the new running max without a reduction step; thread t then turns
            #    its own score into a softmax weight under that max.
            tile_max = running_max
            for j in range(keys_in_tile):
                tile_max = max(tile_max, scores[j])
            if thread < keys_in_tile:
                weights[thread] = math.exp(scores[thread] - tile_max)
            cuda.syncthreads()

            # 3. Thread t owns output dims t, t + threads, ...: rescale them to the new max,
            #    then add the tile's weighted values (consecutive threads, consecutive dims).
            correction = math.exp(running_max - tile_max)  # exp(-inf) = 0 on the first tile
            denominator *= correction
            for i in range(dims_per_thread):
                weighted_sum[i] *= correction
            for j in range(keys_in_tile):
                denominator += weights[j]
                key = tile_start + j
                block = block_tables[seq, key // block_size]
                offset = key % block_size
                for i in range(dims_per_thread):
                    d = thread + i * threads
                    if d < head_dim:
                        value = float32(value_cache[block, offset, kv_head, d])
                        weighted_sum[i] += weights[j] * value
            running_max = tile_max
            cuda.syncthreads()  # the next tile overwrites scores and weights

        for i in range(dims_per_thread):
            d = thread + i * threads
            if d < head_dim:
                output[row, head, d] = weighted_sum[i] / denominator

    return paged_attention_kernel


class NumbaCudaAttentionBackend(AttentionBackend):
    """`build_kernel`'s kernel behind the backend contract.

    On a GPU it takes CUDA tensors; in the simulator (tests, no GPU) it takes CPU tensors.
    ``threads`` is the CUDA block size; the default is 64 on a GPU, 4 in the simulator.
    """

    name = "numba-cuda"
    supported_dtypes = (torch.float32, torch.float16)
    supported_devices = ("cpu",) if simulator_enabled() else ("cuda",)

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        self.threads = threads

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.check_supported(query.dtype, query.device)
        if key_cache.dtype != query.dtype:
            raise ValueError(f"query is {query.dtype} but the KV cache is {key_cache.dtype}")
        num_tokens, num_heads, head_dim = query.shape
        output = torch.empty_like(query, memory_format=torch.contiguous_format)
        if num_tokens == 0:
            return output
        kernel = build_kernel(self.threads, cdiv(head_dim, self.threads))
        args = (
            query,
            key_cache,
            value_cache,
            metadata.cu_seqlens_q.to(torch.int32),
            metadata.context_lens.to(torch.int32),
            metadata.block_tables.to(torch.int32),
        )
        grid = (num_tokens, num_heads)
        if simulator_enabled():
            arrays = [t.detach().contiguous().numpy() for t in args]
            kernel[grid, self.threads](*arrays, np.float32(scale), output.numpy())
        else:
            arrays = [cuda.as_cuda_array(t.detach(), sync=False) for t in args]
            out = cuda.as_cuda_array(output, sync=False)
            stream = cuda.external_stream(torch.cuda.current_stream(query.device).cuda_stream)
            kernel[grid, self.threads, stream](*arrays, np.float32(scale), out)
        return output
