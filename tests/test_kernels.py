"""Every attention backend computes the same thing as the torch reference.

Property tests draw random paged batches (block sizes, shuffled block tables, decodes,
prefill chunks and whole prompts, GQA head counts, head dims, thread counts); explicit
tests pin the block-boundary edge cases the small engines got wrong. The numba.cuda
kernel runs in numba's CUDA simulator (conftest.py), so its shapes stay tiny.

Cache slots that belong to no sequence's context hold NaN: a kernel that reads past a
context, or follows a padding entry of a block table, produces NaN or a wrong value.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import minivllm_kernels.numba_cpu  # noqa: F401  (first: it picks numba's threading layer)
import numba
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.attention import AttentionMetadata, get_backend, write_kv_cache

REPO = Path(__file__).resolve().parents[1]
ON_REAL_GPU = os.environ.get("MINIVLLM_REAL_GPU") == "1"
# Where the numba.cuda kernel runs: a GPU under `make gpu-check`, the simulator otherwise.
CUDA_DEVICE = "cuda" if ON_REAL_GPU else "cpu"
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3)}  # (atol, rtol)


@dataclass
class PagedBatch:
    """One step's attention inputs plus the dense per-sequence keys/values behind them."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float
    keys: list[torch.Tensor]  # per sequence: [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    def to(self, device: str) -> PagedBatch:
        m = self.metadata
        metadata = AttentionMetadata(
            *(t.to(device) for t in (m.slot_mapping, m.cu_seqlens_q, m.context_lens)),
            m.block_tables.to(device),
            m.max_query_len,
            m.max_context_len,
        )
        return PagedBatch(
            self.query.to(device),
            self.key_cache.to(device),
            self.value_cache.to(device),
            metadata,
            self.scale,
            self.keys,
            self.values,
        )


def paged_slots(block_table: list[int], positions: range, block_size: int) -> list[int]:
    """The flat cache slot of each token position: the paged address in one line."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def build_batch(
    context_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    *,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 8,
    block_size: int = 4,
    padding: int = 1,
    num_blocks: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """A batch whose sequence ``i`` has ``context_lens[i]`` tokens in blocks
    ``block_tables[i]`` (each table exactly ``ceil(context_len / block_size)`` long) and
    whose last ``query_lens[i]`` tokens are queries. Tables get ``padding`` extra 0s."""
    generator = torch.Generator().manual_seed(seed)
    if num_blocks is None:
        num_blocks = max(max(table) for table in block_tables) + 2  # one block nobody uses
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    value_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    keys, values, new_slots = [], [], []
    for context_len, query_len, table in zip(context_lens, query_lens, block_tables):
        assert len(table) == -(-context_len // block_size)
        keys.append(torch.randn(context_len, num_kv_heads, head_dim, generator=generator))
        values.append(torch.randn(context_len, num_kv_heads, head_dim, generator=generator))
        slots = torch.tensor(paged_slots(table, range(context_len), block_size))
        write_kv_cache(keys[-1].to(dtype), values[-1].to(dtype), key_cache, value_cache, slots)
        new_slots += slots[context_len - query_len :].tolist()
    width = max(len(table) for table in block_tables) + padding
    padded_tables = [table + [0] * (width - len(table)) for table in block_tables]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    return PagedBatch(query.to(dtype), key_cache, value_cache, metadata, scale, keys, values)


@st.composite
def paged_batches(
    draw,
    *,
    max_seqs: int,
    max_context: int,
    max_query_len: int,
    max_kv_heads: int,
    max_group: int,
    head_dims: list[int],
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> PagedBatch:
    """Random mixed batches: each sequence is a decode, a prefill chunk or a whole prompt;
    block ids are a shuffled range, so tables are non-contiguous and may use block 0."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    context_lens, query_lens = [], []
    for _ in range(draw(st.integers(1, max_seqs))):
        kind = draw(st.sampled_from(["decode", "prefill chunk", "whole prompt"]))
        if kind == "whole prompt":
            context_len = draw(st.integers(1, max_query_len))
            query_len = context_len
        else:
            context_len = draw(st.integers(1, max_context))
            longest = min(context_len, max_query_len)
            query_len = 1 if kind == "decode" else draw(st.integers(1, longest))
        context_lens.append(context_len)
        query_lens.append(query_len)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    block_ids = draw(st.permutations(range(sum(blocks_per_seq) + draw(st.integers(0, 2)))))
    starts = [0, *torch.tensor(blocks_per_seq).cumsum(0).tolist()]
    tables = [list(block_ids[a:b]) for a, b in zip(starts, starts[1:])]
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    return build_batch(
        context_lens,
        query_lens,
        tables,
        num_heads=num_kv_heads * draw(st.integers(1, max_group)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        block_size=block_size,
        padding=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(dtypes)),
    )


def run_backend(name: str, batch: PagedBatch, **options) -> torch.Tensor:
    """The backend's output for ``batch``, on the CPU."""
    device = CUDA_DEVICE if name == "numba-cuda" else "cpu"
    batch = batch.to(device)
    backend = get_backend(name)(**options)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, batch.scale)
    return backend.forward(*args).cpu()


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Causal attention from the dense keys/values in float64: the cache is not involved."""
    rows = []
    starts = batch.metadata.cu_seqlens_q.tolist()
    for i, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        context_len, num_kv_heads, _ = keys.shape
        for j, query in enumerate(batch.query[starts[i] : starts[i + 1]].double()):
            position = context_len - (starts[i + 1] - starts[i]) + j
            group = query.shape[0] // num_kv_heads
            k = keys[: position + 1].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
            v = values[: position + 1].double().repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,nhd->hn", query, k) * batch.scale, -1)
            rows.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(rows)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected.to(dtype), atol=atol, rtol=rtol)


@contextmanager
def numba_threads(count: int):
    """numba and torch both on ``count`` threads (the kernel uses no more than torch's)."""
    previous, previous_torch = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(count)
    torch.set_num_threads(count)
    try:
        yield
    finally:
        numba.set_num_threads(previous)
        torch.set_num_threads(previous_torch)


@contextmanager
def numba_serial_work_limit(limit: int):
    import minivllm_kernels.numba_cpu as numba_cpu

    previous = numba_cpu.SERIAL_WORK_LIMIT
    numba_cpu.SERIAL_WORK_LIMIT = limit
    try:
        yield
    finally:
        numba_cpu.SERIAL_WORK_LIMIT = previous


# --- property tests: each backend equals the torch reference -----------------------------


@given(
    batch=paged_batches(
        max_seqs=6,
        max_context=80,
        max_query_len=24,
        max_kv_heads=3,
        max_group=4,
        head_dims=[1, 3, 8, 16, 64, 128],
    ),
    threads=st.integers(1, numba.config.NUMBA_NUM_THREADS),
    serial=st.booleans(),
)
def test_numba_cpu_equals_torch_reference(batch: PagedBatch, threads: int, serial: bool) -> None:
    """Both launch paths: the serial kernel small steps use and the parallel one."""
    with numba_threads(threads), numba_serial_work_limit(2**62 if serial else -1):
        actual = run_backend("numba-cpu", batch)
    assert_matches(actual, run_backend("torch", batch), torch.float32)


# Tiny shapes: the simulator costs ~20 ms per (query row, head) pair (NOTES-kernels.md).
@given(
    batch=paged_batches(
        max_seqs=4,
        max_context=40,
        max_query_len=6,
        max_kv_heads=3,
        max_group=3,
        head_dims=[1, 5, 8, 16, 32],
        dtypes=(torch.float32, torch.float16),
    ),
    threads=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_numba_cuda_equals_torch_reference(batch: PagedBatch, threads: int) -> None:
    actual = run_backend("numba-cuda", batch, threads=threads)
    assert_matches(actual, run_backend("torch", batch), batch.query.dtype)


# --- edge cases, each against attention computed without the paged cache ----------------

ALL_BACKENDS = ["torch", "numba-cpu", "numba-cuda"]

# name -> (context_lens, query_lens, block_tables) with block_size 4.
EDGE_CASES = {
    "context length 1": ([1, 1, 6], [1, 1, 2], [[3], [1], [0, 2]]),
    "context a multiple of the block size": ([8, 8, 4], [1, 8, 4], [[5, 2], [0, 4], [1]]),
    "chunk ends on a block boundary": ([8, 12], [3, 4], [[4, 1], [2, 0, 5]]),
    "chunk starts on a block boundary": ([6, 9], [2, 1], [[3, 0], [1, 4, 2]]),
    # Block 0 is a real block of the first sequence and padding in the others' tables:
    # following a padding entry would read the first sequence's keys, not NaN.
    "block 0 both real and padding": ([3, 5, 1], [3, 1, 1], [[0], [2, 1], [3]]),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_case_matches_dense_attention(backend: str, case: str) -> None:
    context_lens, query_lens, tables = EDGE_CASES[case]
    batch = build_batch(context_lens, query_lens, tables, num_heads=4, num_kv_heads=2, padding=2)
    assert_matches(run_backend(backend, batch), dense_attention(batch), torch.float32)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_fresh_token_at_block_boundary_is_written_to_the_new_block(backend: str) -> None:
    """nano-vllm's off-by-one: a decode token at a block boundary written one slot past
    the allocated block. With `context_lens` counting the new token, position 8 with
    block size 4 is slot 0 of the third block, which was allocated for it."""
    block_size, computed = 4, 8
    batch = build_batch([computed], [computed], [[5, 2]], block_size=block_size, num_blocks=9)
    key_cache, value_cache = batch.key_cache, batch.value_cache
    new_key, new_value = torch.randn(2, 1, 1, 8).unbind(0)
    table = [5, 2, 7]  # block 7 freshly allocated for the token at position 8
    slot = paged_slots(table, range(computed, computed + 1), block_size)
    write_kv_cache(new_key, new_value, key_cache, value_cache, torch.tensor(slot))

    assert slot == [7 * block_size]
    assert torch.equal(key_cache[7, 0], new_key[0])
    assert key_cache[7, 1:].isnan().all() and key_cache[[0, 1, 3, 4, 6, 8]].isnan().all()

    step = build_batch([computed + 1], [1], [table], block_size=block_size)
    step.key_cache, step.value_cache = key_cache, value_cache
    step.keys = [torch.cat([batch.keys[0], new_key])]
    step.values = [torch.cat([batch.values[0], new_value])]
    assert_matches(run_backend(backend, step), dense_attention(step), torch.float32)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_long_context_with_huge_scores_stays_exact(backend: str) -> None:
    """Scores of several hundred would overflow exp() without the running max; 300 keys
    span many cache blocks and CUDA tiles, so the max is rescaled many times."""
    tables = [list(range(75, 0, -1))]  # 75 blocks of 4, in reverse order
    batch = build_batch([300], [2], tables, num_heads=2, num_kv_heads=1)
    batch.query *= 40.0
    output = run_backend(backend, batch)
    assert output.isfinite().all()
    assert_matches(output, dense_attention(batch), torch.float32)


@pytest.mark.parametrize("backend", ["numba-cpu", "numba-cuda"])
def test_query_sliced_from_a_fused_projection(backend: str) -> None:
    """The model slices q out of one qkv matmul, so the query is not contiguous."""
    batch = build_batch([5, 3], [5, 1], [[2, 0], [1]], num_heads=4, num_kv_heads=2)
    fused = torch.cat([batch.query, torch.zeros_like(batch.query)], dim=1)
    batch.query = fused[:, :4]
    assert not batch.query.is_contiguous()
    assert_matches(run_backend(backend, batch), dense_attention(batch), torch.float32)


def test_dense_reference_detects_a_wrong_context() -> None:
    """The edge-case oracle is sharp: dropping the last key changes the answer."""
    batch = build_batch([6], [1], [[1, 0]])
    truncated = build_batch([6], [1], [[1, 0]])
    truncated.metadata.context_lens[0] = 5  # sees keys 0..4 as the row at position 4
    expected = dense_attention(batch)
    assert not torch.allclose(run_backend("numba-cpu", truncated), expected.float(), atol=1e-3)


# --- supported dtypes and devices --------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "dtype", "device", "message"),
    [
        ("numba-cpu", torch.float16, "cpu", "does not support dtype float16"),
        ("numba-cpu", torch.bfloat16, "cpu", "does not support dtype bfloat16"),
        ("numba-cpu", torch.float32, "cuda", "does not run on device 'cuda'"),
        ("numba-cuda", torch.bfloat16, CUDA_DEVICE, "does not support dtype bfloat16"),
        ("numba-cuda", torch.float32, "mps", "does not run on device 'mps'"),
    ],
)
def test_unsupported_combination_is_a_clear_error(backend, dtype, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        get_backend(backend).check_supported(dtype, device)


def test_numba_cpu_forward_refuses_fp16_before_reaching_numba() -> None:
    batch = build_batch([4], [1], [[1]], dtype=torch.float16)
    with pytest.raises(ValueError, match="numba-cpu"):
        run_backend("numba-cpu", batch)


def test_numba_cuda_refuses_a_cache_of_another_dtype() -> None:
    batch = build_batch([4], [1], [[1]])
    batch.query = batch.query.half()
    with pytest.raises(ValueError, match="KV cache"):
        run_backend("numba-cuda", batch)


# --- threading and speed of the CPU kernel -----------------------------------------------


needs_two_threads = pytest.mark.skipif(
    numba.config.NUMBA_NUM_THREADS < 2, reason="the parallel kernel needs two numba threads"
)


@needs_two_threads
def test_numba_cpu_uses_workqueue_and_leaves_torch_threads_alone() -> None:
    with numba_threads(2), numba_serial_work_limit(-1):  # else this batch runs serially
        run_backend("numba-cpu", build_batch([4], [1], [[1]]))
        assert torch.get_num_threads() == 2
    if "NUMBA_THREADING_LAYER" not in os.environ:
        assert numba.threading_layer() == "workqueue"


@needs_two_threads
def test_numba_cpu_uses_no_more_threads_than_torch(monkeypatch) -> None:
    """With torch on one thread (``--threads 1``) the parallel kernel is never launched."""
    import minivllm_kernels.numba_cpu as numba_cpu

    launches = []
    monkeypatch.setattr(numba_cpu, "paged_attention_kernel", lambda *args: launches.append(args))
    batch = build_batch([4], [1], [[1]])
    with numba_threads(2), numba_serial_work_limit(-1):
        torch.set_num_threads(1)
        expected = run_backend("torch", batch)
        actual = run_backend("numba-cpu", batch)  # serial: computes the real answer
        assert launches == []
        torch.set_num_threads(2)
        run_backend("numba-cpu", batch)
    assert len(launches) == 1 and launches[0][-1] == 2  # two workers
    assert_matches(actual, expected, torch.float32)


def realistic_decode_batch(seed: int = 0) -> PagedBatch:
    """32 decodes with SmolLM2's attention shapes, contexts 100-500, block size 16."""
    generator = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(100, 501, (32,), generator=generator).tolist()
    blocks_per_seq = [-(-n // 16) for n in context_lens]
    block_ids = torch.randperm(sum(blocks_per_seq), generator=generator).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(block_ids[start : start + n])
        start += n
    return build_batch(
        context_lens, [1] * 32, tables, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16
    )


def median_seconds(fn, repeats: int = 7) -> float:
    fn()  # warm up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def test_numba_cpu_is_faster_than_torch_reference_on_a_decode_batch() -> None:
    """The reason numba-cpu exists (measured ~1.5-2 ms vs 6-30 ms; benchmarks/attention.py)."""
    batch = realistic_decode_batch()
    numba_time = median_seconds(lambda: run_backend("numba-cpu", batch))
    torch_time = median_seconds(lambda: run_backend("torch", batch))
    assert numba_time < torch_time, f"numba-cpu {numba_time:.4f} s, torch {torch_time:.4f} s"


# --- the CUDA kernel compiles for a real GPU (no GPU needed) ------------------------------

PTX_SCRIPT = """
import types
import numba.cuda.dispatcher as dispatcher
from numba.cuda.cudadrv.nvrtc import _get_nvrtc_version
from numba.cuda.cudadrv.nvvm import NVVM
try:  # both libraries compile_ptx needs; `pip install minivllm[ptx]` brings them
    NVVM()
    _get_nvrtc_version()
except Exception as error:
    print(f"libNVVM / NVRTC not found: pip install -e '.[ptx]' ({type(error).__name__}: {error})")
    raise SystemExit(77)
# compile_ptx looks up the current GPU to compile device functions; there is none here.
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, float32, int32, types as nt
from minivllm_kernels.numba_cuda import build_kernel

for threads, dims_per_thread in [(64, 1), (64, 2)]:
    kernel = build_kernel(threads, dims_per_thread)
    for dtype in (nt.float16, nt.float32):
        rows, cache = nt.Array(dtype, 3, "C"), nt.Array(dtype, 4, "C")
        ints, table = nt.Array(int32, 1, "C"), nt.Array(int32, 2, "C")
        signature = (rows, cache, cache, ints, ints, table, float32, rows)
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        assert ".target sm_90" in ptx, ptx[:500]
        float64_lines = [line for line in ptx.splitlines() if ".f64" in line]
        assert not float64_lines, float64_lines[:5]
print("OK")
"""


@pytest.mark.skipif(ON_REAL_GPU, reason="the GPU run compiles and runs the kernel for real")
def test_cuda_kernel_compiles_to_sm90_ptx_without_float64() -> None:
    """Typing/lowering errors the simulator never sees; float64 would be slow on a GPU.
    Needs libNVVM and NVRTC: the ``ptx`` extra, which `make install` installs."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    result = subprocess.run(
        [sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True, cwd=REPO
    )
    if result.returncode == 77:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "OK"


# --- benchmarks/gpu_check.py runs on CPU too, as far as it can ---------------------------


def test_gpu_check_benchmark_runs_in_the_simulator(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu_check import benchmark_decode

    rows = benchmark_decode(CUDA_DEVICE, {"tiny": [3, 17]}, (torch.float32,), repeats=1)
    assert [row["path"] for row in rows] == ["numba-cuda", "torch SDPA, padded", "torch reference"]
    assert all(row["ms"] > 0 for row in rows)


def test_gpu_check_parity_runs_in_the_simulator(tiny_llama_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu_check import check_smollm2_parity

    check_smollm2_parity(CUDA_DEVICE, str(tiny_llama_path), ["w1 w2 w3"], max_tokens=2)


@pytest.mark.skipif(ON_REAL_GPU, reason="a property of numba's CUDA simulator")
def test_simulated_threads_share_one_shared_array():
    """numba-cuda's simulator creates a shared array without a lock, so simulated threads
    could each get their own copy; minivllm_kernels.numba_cuda serializes the lookup."""
    import threading

    import minivllm_kernels.numba_cuda  # noqa: F401  (installs the fix)
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    def allocate(shared, barrier, arrays):
        barrier.wait()  # all threads reach the allocating line together
        arrays.append(shared.array(4, numba.float32))

    for _ in range(100):  # without the fix, about 1 round in 10 hands out copies
        args = (FakeCUDAShared(0), threading.Barrier(8), [])
        threads = [threading.Thread(target=allocate, args=args) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        arrays = args[2]
        assert all(array is arrays[0] for array in arrays)
