"""Paged attention on CPU with numba: the fastest attention path minivllm has on a CPU.

The kernel reads keys and values straight out of the paged cache through the block table
(no gather copy) and keeps a running softmax (max, denominator, weighted sum of values)
per query head, so it never materialises a ``[query_len, context_len]`` score matrix.

While it computes one cache block it prefetches the next one from the block table: blocks
sit anywhere in the cache, where the CPU's own prefetcher cannot follow.

Work is split into (query row, kv head) items: one item computes every query head of a
GQA group, so a key/value vector loaded from memory is reused ``num_heads // num_kv_heads``
times. Items are dealt round-robin to numba's threads, so a causal prefill (whose later
rows see more keys) is spread evenly instead of giving one thread all the long rows.

Threading layer: numba defaults to OpenMP when available. Next to torch's own OpenMP pool
that made this kernel 4-5x slower (two pools of spinning threads on the same cores), so
we pick numba's ``workqueue`` layer unless the user chose one with NUMBA_THREADING_LAYER.
It leaves torch's pool alone. ``workqueue`` does not allow two Python threads to launch
numba kernels at the same time; the engine calls attention from one thread.
"""

from __future__ import annotations

import os
import warnings

import torch

try:
    import numba
    import numpy as np
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError as error:  # tests/test_attention_registry.py hides numba to check this
    raise ImportError(
        "the numba attention backends need numba: pip install minivllm[kernels]"
    ) from error

from minivllm.attention.backend import AttentionBackend, AttentionMetadata

if "NUMBA_THREADING_LAYER" not in os.environ:
    # Read when the first parallel kernel runs, so setting it here (at import) is enough.
    numba.config.THREADING_LAYER = "workqueue"

# Stands in for -inf as the running max before the first key: fastmath lets LLVM assume
# no infinities, and exp(_NO_SCORE - score) is still exactly 0.
_NO_SCORE = np.float32(-3.0e38)
_FLOATS_PER_LINE = 16  # a 64-byte cache line of float32: one prefetch each
_KEYS_PER_CHUNK = 16  # values are summed this many keys at a time (see _add_weighted_values)
# exp(x) = 2**k * exp(r): k = round(x / ln 2), r = x - k ln 2 in two parts for precision.
_LOG2_E = np.float32(1.4426950408889634)
_LN2_HIGH, _LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
_LOWEST_EXP_ARG = np.float32(-87.0)  # exp below it underflows float32's normal range


@njit(parallel=True, fastmath=True, cache=True)
def paged_attention_kernel(
    query,
    key_cache,
    value_cache,
    cu_seqlens_q,
    context_lens,
    block_tables,
    scale,
    output,
    num_workers,
):
    """Causal paged attention for a mixed batch, written into ``output``.

    query, output: ``[num_tokens, num_heads, head_dim]`` float32.
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32.
    cu_seqlens_q ``[num_seqs + 1]``, context_lens ``[num_seqs]``,
    block_tables ``[num_seqs, max_blocks]``: int32, as in `AttentionMetadata`.
    scale: float32. num_workers: how many items run at once (numba's thread count).
    """
    seq_of_row = _sequence_of_each_row(cu_seqlens_q, query.shape[0])
    for worker in prange(num_workers):
        _run_items(worker, num_workers, query, key_cache, value_cache, cu_seqlens_q,
                   context_lens, block_tables, seq_of_row, scale, output)  # fmt: skip


@njit(fastmath=True, cache=True)
def paged_attention_kernel_serial(
    query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, scale, output
):
    """`paged_attention_kernel` on the calling thread: for steps so small (a decode of a
    few sequences) that waking numba's worker threads costs more than the work."""
    seq_of_row = _sequence_of_each_row(cu_seqlens_q, query.shape[0])
    _run_items(0, 1, query, key_cache, value_cache, cu_seqlens_q,
               context_lens, block_tables, seq_of_row, scale, output)  # fmt: skip


@njit(fastmath=True, cache=True)
def _run_items(
    worker,
    num_workers,
    query,
    key_cache,
    value_cache,
    cu_seqlens_q,
    context_lens,
    block_tables,
    seq_of_row,
    scale,
    output,
):
    """Items ``worker, worker + num_workers, ...``; an item is one (query row, kv head)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    # Scratch space for one item, allocated once per worker.
    weighted_sum = np.empty((group_size, head_dim), dtype=np.float32)
    running_max = np.empty(group_size, dtype=np.float32)
    denominator = np.empty(group_size, dtype=np.float32)
    scores = np.empty(block_size, dtype=np.float32)
    exponent_bits = np.empty(block_size, dtype=np.int32)
    for item in range(worker, num_tokens * num_kv_heads, num_workers):
        row, kv_head = item // num_kv_heads, item % num_kv_heads
        seq = seq_of_row[row]
        query_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
        # This row is the last query_len tokens' (row - first row)-th: its position.
        position = context_lens[seq] - query_len + (row - cu_seqlens_q[seq])
        weighted_sum[:] = 0.0
        running_max[:] = _NO_SCORE
        denominator[:] = 0.0
        _attend_to_context(
            query[row],
            key_cache,
            value_cache,
            block_tables[seq],
            position + 1,
            kv_head,
            scale,
            scores,
            exponent_bits,
            weighted_sum,
            running_max,
            denominator,
        )
        for member in range(group_size):
            head = kv_head * group_size + member
            output[row, head, :] = weighted_sum[member] / denominator[member]


@njit(cache=True)
def _sequence_of_each_row(cu_seqlens_q, num_tokens):
    """``[num_tokens]`` int32: the sequence index each flattened query row belongs to."""
    seq_of_row = np.empty(num_tokens, dtype=np.int32)
    for seq in range(cu_seqlens_q.shape[0] - 1):
        seq_of_row[cu_seqlens_q[seq] : cu_seqlens_q[seq + 1]] = seq
    return seq_of_row


@njit(fastmath=True, cache=True)
def _attend_to_context(
    query_row,
    key_cache,
    value_cache,
    block_table,
    num_keys,
    kv_head,
    scale,
    scores,
    exponent_bits,
    weighted_sum,
    running_max,
    denominator,
):
    """Online softmax of one query row's GQA group over its first ``num_keys`` keys.

    query_row: ``[num_heads, head_dim]``. Updates weighted_sum ``[group, head_dim]``,
    running_max ``[group]`` and denominator ``[group]`` in place; scores and
    exponent_bits ``[block_size]`` are scratch. The softmax is rescaled once per cache
    block, not once per key.
    """
    block_size, head_dim = key_cache.shape[1], key_cache.shape[3]
    group_size = weighted_sum.shape[0]
    keys_flat, values_flat = key_cache.reshape(-1), value_cache.reshape(-1)
    block_stride = keys_flat.shape[0] // key_cache.shape[0]  # floats per cache block
    num_blocks = (num_keys + block_size - 1) // block_size
    for block_index in range(num_blocks):
        block = block_table[block_index]
        if kv_head == 0 and block_index + 1 < num_blocks:
            # The next block can sit anywhere in the cache, so the CPU's own prefetcher
            # cannot guess it; the block table knows. Ask for all of it (every kv head: this
            # row's other kv heads come next) while this one is computed.
            next_block = block_table[block_index + 1] * block_stride
            for index in range(next_block, next_block + block_stride, _FLOATS_PER_LINE):
                _prefetch(keys_flat, index)
                _prefetch(values_flat, index)
        keys_in_block = min(block_size, num_keys - block_index * block_size)
        for member in range(group_size):
            q = query_row[kv_head * group_size + member]
            block_max = running_max[member]
            for offset in range(keys_in_block):
                k = key_cache[block, offset, kv_head]
                score = np.float32(0.0)
                for d in range(head_dim):
                    score += q[d] * k[d]
                score *= scale
                scores[offset] = score
                block_max = max(block_max, score)
            # Rescale what was summed under the old max to the new one.
            correction = np.exp(running_max[member] - block_max)
            running_max[member] = block_max
            _exp_shifted(scores, keys_in_block, block_max, exponent_bits)
            block_sum = np.float32(0.0)
            for offset in range(keys_in_block):
                block_sum += scores[offset]
            denominator[member] = denominator[member] * correction + block_sum
            acc = weighted_sum[member]
            for d in range(head_dim):
                acc[d] *= correction
            _add_weighted_values(acc, scores, value_cache, block, kv_head, keys_in_block)


@njit(fastmath=True, cache=True, inline="always")
def _exp_shifted(values, count, shift, exponent_bits):
    """``values[:count] = exp(values[:count] - shift)``, for arguments <= 0.

    libm's ``expf`` is one call per key, which LLVM cannot vectorise; this form it can:
    exp(x) = 2**k * exp(r) with k = round(x / ln 2) and |r| <= ln(2) / 2, exp(r) by its
    Taylor series to r**6 (relative error below 4e-7), and 2**k written straight into a
    float32's exponent bits. Arguments below -87 give ~1e-38: nothing next to the block's
    largest weight, which is exp(0) = 1.
    """
    powers_of_two = exponent_bits.view(np.float32)
    for i in range(count):
        x = max(values[i] - shift, _LOWEST_EXP_ARG)
        k = np.floor(x * _LOG2_E + np.float32(0.5))
        r = (x - k * _LN2_HIGH) - k * _LN2_LOW
        taylor = np.float32(1.0 / 720.0)  # Horner: 1 + r(1 + r(1/2 + r(1/6 + ...)))
        taylor = taylor * r + np.float32(1.0 / 120.0)
        taylor = taylor * r + np.float32(1.0 / 24.0)
        taylor = taylor * r + np.float32(1.0 / 6.0)
        taylor = taylor * r + np.float32(0.5)
        taylor = taylor * r + np.float32(1.0)
        taylor = taylor * r + np.float32(1.0)
        values[i] = taylor
        exponent_bits[i] = (np.int32(k) + 127) << 23
    for i in range(count):
        values[i] *= powers_of_two[i]


@njit(fastmath=True, cache=True, inline="always")
def _add_weighted_values(acc, weights, value_cache, block, kv_head, num_keys):
    """``acc += sum over the block's first num_keys keys of weights[key] * value[key]``.

    Sixteen keys at a time with the head dimension as the outer loop: LLVM unrolls the
    fixed-length key loop and vectorises over ``d``, so each ``acc[d]`` is loaded and
    stored once per 16 keys. Key by key, ``acc`` would make a round trip through memory
    for every key: numba cannot tell LLVM that ``acc`` and the cache never overlap, so it
    is not kept in registers.
    """
    head_dim = acc.shape[0]
    if num_keys == _KEYS_PER_CHUNK:
        for d in range(head_dim):
            total = acc[d]
            for key in range(_KEYS_PER_CHUNK):
                total += weights[key] * value_cache[block, key, kv_head, d]
            acc[d] = total
    else:  # other block sizes, and a sequence's last, partly filled block
        for key in range(num_keys):
            weight = weights[key]
            for d in range(head_dim):
                acc[d] += weight * value_cache[block, key, kv_head, d]


@intrinsic
def _prefetch(typingctx, array, index):
    """``array[index]``'s cache line, requested without waiting for it: LLVM's prefetch
    (a hint; where a CPU has no such instruction it compiles to nothing)."""

    def codegen(context, builder, signature, args):
        data, position = args
        array_struct = context.make_array(signature.args[0])(context, builder, data)
        pointer = builder.gep(array_struct.data, [position])
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
            "llvm.prefetch.p0i8",
        )
        # read (0), keep in all cache levels (locality 3), data not instructions (1)
        builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


# Below this much work per call (query rows x longest context x heads x head_dim, an upper
# bound on the multiply-adds) the kernel runs on the calling thread. On the 2-core
# development box, inside whole decode steps, the serial kernel was faster at every decode
# size measured, up to 32 sequences with contexts up to ~500 tokens (`profile_decode.py
# --numba-launch`, two torch threads: median step 98.3 vs 105.2 ms at 32 sequences, 52.3
# vs 64.6 ms at 16): between torch's ops its OpenMP threads spin-wait on the other core,
# where a numba worker would have to run.
SERIAL_WORK_LIMIT = 32 * 500 * 9 * 64


def attention_threads() -> int:
    """Threads the kernel may use: numba's, but never more than torch's, so that a run
    limited to N threads (``torch.set_num_threads``, ``--threads``) stays within N. With
    torch on one thread, the parallel kernel on numba's two made whole decode steps slower
    (median 48.0 vs 35.8 ms at 4 sequences, 168.9 vs 156.7 ms at 32)."""
    return min(numba.get_num_threads(), torch.get_num_threads())


class NumbaCpuAttentionBackend(AttentionBackend):
    """`paged_attention_kernel` behind the backend contract: fp32 on CPU."""

    name = "numba-cpu"
    supported_dtypes = (torch.float32,)
    supported_devices = ("cpu",)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.check_supported(query.dtype, query.device)
        # A query sliced out of a fused qkv projection is strided; numba would compile a
        # second, slower specialisation for it, so make it dense (a small copy).
        query = query.contiguous()
        output = torch.empty_like(query)
        arrays = (
            query.detach().numpy(),
            key_cache.detach().numpy(),
            value_cache.detach().numpy(),
            _as_int32(metadata.cu_seqlens_q),
            _as_int32(metadata.context_lens),
            _as_int32(metadata.block_tables),
            np.float32(scale),
            output.numpy(),
        )
        num_tokens, num_heads, head_dim = query.shape
        work = num_tokens * metadata.max_context_len * num_heads * head_dim
        threads = attention_threads()
        if threads == 1 or work <= SERIAL_WORK_LIMIT:
            paged_attention_kernel_serial(*arrays)
        else:
            paged_attention_kernel(*arrays, threads)
            _warn_once_if_slow_threading_layer()
        return output


def _as_int32(index: torch.Tensor) -> np.ndarray:
    if index.dtype != torch.int32 or not index.is_contiguous():  # as the contract says
        index = index.to(torch.int32).contiguous()
    return index.numpy()


_layer_checked = False


def _warn_once_if_slow_threading_layer() -> None:
    """numba picks its threading layer on the first parallel launch; say if it is slow."""
    global _layer_checked
    if _layer_checked:
        return
    _layer_checked = True
    layer = numba.threading_layer()
    if layer != "workqueue" and "NUMBA_THREADING_LAYER" not in os.environ:
        warnings.warn(
            f"numba is using the {layer!r} threading layer (a parallel numba kernel ran "
            "before minivllm_kernels was imported); next to torch's OpenMP pool the "
            "numba-cpu attention backend can be several times slower than with 'workqueue'",
            stacklevel=3,
        )


__all__ = ["NumbaCpuAttentionBackend", "paged_attention_kernel", "paged_attention_kernel_serial"]
