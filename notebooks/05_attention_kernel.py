# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. Write your own attention kernel
#
# Everything in minivllm that touches the paged KV cache for *reading* is one function:
# `AttentionBackend.forward`. The model calls it once per layer per step. Swap the backend
# and the engine runs a different kernel; nothing else changes. In this notebook we
#
# 1. read the contract (`minivllm/attention/backend.py`);
# 2. write a new backend in a dozen lines of torch;
# 3. check it against the reference with a hypothesis property test;
# 4. register it and generate text with it on SmolLM2;
# 5. read the numba.cuda kernel (`kernels/numba_cuda.py`) and run it in numba's CUDA
#    simulator, on this CPU.
#
# The simulator is chosen when `numba.cuda` is first imported, so we switch it on first.

# %%
import os
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # numba.cuda runs on the CPU, one thread per thread
sys.setswitchinterval(1e-5)  # the simulator's threads take turns much faster this way

import inspect  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from IPython.display import Markdown  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.attention import (  # noqa: E402
    AttentionBackend,
    AttentionMetadata,
    available_backends,
    get_backend,
    register_backend,
)

print("backends:", available_backends())


def show_code(code: str) -> Markdown:
    """Display source code with syntax highlighting."""
    return Markdown(f"```python\n{code}\n```")


# %% [markdown]
# ## 1. The contract
#
# A backend subclasses `AttentionBackend`, names itself, says which dtypes and devices it
# supports, and implements `forward`:

# %%
show_code(inspect.getsource(AttentionBackend.forward))

# %% [markdown]
# The query rows of every scheduled sequence are stacked in one `[num_tokens, num_heads,
# head_dim]` tensor. `AttentionMetadata` says which rows belong to which sequence and where
# that sequence's keys and values live. The keys and values of *this* step are already in
# the cache (`write_kv_cache` ran just before), so a backend only reads.

# %%
show_code(inspect.getsource(AttentionMetadata).split("    @property")[0])


# %% [markdown]
# To try a backend we need a batch. `random_batch` builds one the way the model runner
# would: a few sequences with random context lengths, each ending in a chunk of new query
# rows (a chunk of 1 is a decode), their blocks scattered over a shuffled pool.


# %%
def random_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # non-contiguous, out-of-order block ids
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),  # unused: nothing is written
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    return query, key_cache, value_cache, metadata


# A decode with 9 tokens of context, and a 5-token prefill chunk ending at token 13.
query, key_cache, value_cache, metadata = random_batch(query_lens=[1, 5], context_lens=[9, 13])
reference = get_backend("torch")()
expected = reference.forward(query, key_cache, value_cache, metadata, scale=8**-0.5)
print("query", tuple(query.shape), "-> output", tuple(expected.shape))
print("block tables:\n", metadata.block_tables)

# %% [markdown]
# ## 2. A backend of our own
#
# The reference backend gathers each *sequence's* keys once and runs a masked
# `scaled_dot_product_attention`. Ours takes the other obvious route: one query *row* at a
# time. Row `r` of sequence `s` is at position `p = context_len - query_len + j`, so it
# sees keys `0..p`; key `k` lives in block `block_tables[s, k // block_size]` at offset
# `k % block_size`. With grouped-query attention, query head `h` reads KV head
# `h // (num_heads // num_kv_heads)`.


# %%
@register_backend
class RowByRowBackend(AttentionBackend):
    """One query row at a time: gather the keys it may see, softmax, weighted sum."""

    name = "row-by-row"
    supported_dtypes = (torch.float32,)
    supported_devices = ("cpu",)

    def forward(self, query, key_cache, value_cache, metadata, scale):
        block_size = key_cache.shape[1]
        group = query.shape[1] // key_cache.shape[2]  # query heads per KV head
        output = torch.empty_like(query)
        cu = metadata.cu_seqlens_q.tolist()
        for s, context_len in enumerate(metadata.context_lens.tolist()):
            query_len = cu[s + 1] - cu[s]
            for j in range(query_len):
                row, position = cu[s] + j, context_len - query_len + j
                keys_seen = torch.arange(position + 1)
                blocks = metadata.block_tables[s, keys_seen // block_size].long()
                offsets = keys_seen % block_size
                k = key_cache[blocks, offsets].repeat_interleave(group, dim=1)  # [keys, H, D]
                v = value_cache[blocks, offsets].repeat_interleave(group, dim=1)
                scores = torch.einsum("hd,khd->hk", query[row], k) * scale
                output[row] = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), v)
        return output


mine = get_backend("row-by-row")()
actual = mine.forward(query, key_cache, value_cache, metadata, scale=8**-0.5)
print("max |difference| from the reference:", (actual - expected).abs().max().item())
print("backends now:", available_backends())

# %% [markdown]
# ## 3. A property test against the reference
#
# One example proves little. Hypothesis draws many batches: numbers of sequences, query
# lengths (decodes and prefill chunks), context lengths, block sizes, head counts with
# different GQA ratios, head dims. Every one must match the reference. This is the same
# kind of test that keeps minivllm's own kernels honest (`tests/test_kernels.py`).


# %%
@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 3))
    context_lens = draw(st.lists(st.integers(1, 24), min_size=num_seqs, max_size=num_seqs))
    query_lens = [draw(st.integers(1, c)) for c in context_lens]
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        query_lens=query_lens,
        context_lens=context_lens,
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=40, deadline=None)
@given(batches())
def test_row_by_row_matches_reference(shape):
    query, key_cache, value_cache, metadata = random_batch(**shape)
    scale = shape["head_dim"] ** -0.5
    expected = reference.forward(query, key_cache, value_cache, metadata, scale)
    actual = mine.forward(query, key_cache, value_cache, metadata, scale)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


start = time.perf_counter()
test_row_by_row_matches_reference()
print(f"40 random batches match the reference ({time.perf_counter() - start:.1f} s)")

# %% [markdown]
# ## 4. Plugging it into the engine
#
# `register_backend` made the class selectable by name, so `LLM(attention_backend=...)`
# accepts it. (A backend in another package registers itself through the
# `minivllm.attention_backends` entry point group instead, so users need not import it.)
# Greedy decoding with our backend should give the same tokens as the reference on the
# real model:

# %%
prompts = ["The capital of France is", "A paged KV cache stores"]
params = SamplingParams(temperature=0, max_tokens=8)
llm = LLM(attention_backend="row-by-row", num_kv_blocks=64)
ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
# Same engine, same weights: switch every layer's backend back to the reference.
for layer in llm.llm_engine.executor.model.layers:
    layer.self_attn.backend = reference
theirs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
for prompt, token_ids in zip(prompts, ours):
    print(f"{prompt!r} -> {llm.get_tokenizer().decode(token_ids)!r}")
assert ours == theirs, (ours, theirs)
print("row-by-row and torch backends: same greedy tokens")

# %% [markdown]
# ## 5. The numba.cuda kernel, in the simulator
#
# The GPU kernel follows the same contract. Its launch grid is `(num_tokens, num_heads)`:
# one CUDA block per query row and head. The block's threads walk the row's keys in tiles;
# each thread scores one key of a tile, reading it straight from the paged cache through
# the block table. An *online softmax* keeps a running maximum and denominator, so no
# score matrix is stored and the context can be any length. Here is the kernel:

# %%
from minivllm_kernels import numba_cuda  # noqa: E402

source = inspect.getsource(numba_cuda.build_kernel)
show_code(source[source.index("    @cuda.jit") :])

# %% [markdown]
# Things to find in it:
#
# - `sequence_of_row` (a binary search in `cu_seqlens_q`) and `num_keys`: the same
#   position arithmetic as our row-by-row backend.
# - `block_tables[seq, key // block_size]` and `key % block_size`: the paged address.
# - `correction = exp(running_max - tile_max)`: rescaling what was summed so far when a
#   larger score shows up. That is the whole trick of online softmax.
# - `cuda.shared.array` for the scaled query and the tile's scores, and
#   `cuda.syncthreads()` between writing and reading them.
#
# With `NUMBA_ENABLE_CUDASIM=1`, numba runs each CUDA thread as a Python thread, so the
# kernel runs on CPU tensors (slowly, so the batch is tiny) and a failure is an ordinary
# Python traceback. The registry gives us the backend like any other:

# %%
cuda_backend = get_backend("numba-cuda")(threads=4)
query, key_cache, value_cache, metadata = random_batch(query_lens=[1, 3], context_lens=[9, 6])
start = time.perf_counter()
out = cuda_backend.forward(query, key_cache, value_cache, metadata, scale=8**-0.5)
elapsed = time.perf_counter() - start
expected = reference.forward(query, key_cache, value_cache, metadata, scale=8**-0.5)
print(f"simulated launch: grid {(query.shape[0], query.shape[1])} x 4 threads, {elapsed:.1f} s")
print("max |difference| from the reference:", (out - expected).abs().max().item())
torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)

# %% [markdown]
# On a machine with an NVIDIA GPU, the same source compiles to PTX and takes torch CUDA
# tensors without a copy; `benchmarks/gpu_check.py` (`make gpu-check`) runs the property
# tests and a benchmark there. On CPU, the `numba-cpu` backend (`kernels/numba_cpu.py`)
# compiles the same idea with `@njit(parallel=True)`. The
# [Attention kernels](../kernels.md) page explains both, with measurements.
#
# **What to remember**
#
# - A backend is one `forward(query, key_cache, value_cache, metadata, scale)`; the cache
#   write is shared, so a backend only reads.
# - Query rows know their sequence from `cu_seqlens_q`, their position from
#   `context_lens`, and find their keys through `block_tables`.
# - Test a new kernel against the reference on many random batches before trusting it,
#   then select it by name.
