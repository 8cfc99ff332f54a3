"""Random attention inputs for one engine step, for the kernel benchmarks.

`benchmarks/attention.py` (CPU) and `benchmarks/gpu_check.py` (GPU) time the backends on the same
kind of batch: random queries, a paged KV cache whose block ids are shuffled (so block
tables are non-contiguous, as after requests come and go), SmolLM2-135M's head shapes.
"""

from __future__ import annotations

import torch

from minivllm.attention import AttentionMetadata
from minivllm.utils import cdiv

# SmolLM2-135M's attention: 9 query heads sharing 3 kv heads, head_dim 64.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def random_paged_step(
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(query, key_cache, value_cache, metadata)``: sequence ``i`` has ``context_lens[i]``
    tokens in the cache, of which the last ``query_lens[i]`` are this step's queries."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, BLOCK_SIZE) for n in context_lens]
    block_ids = torch.randperm(sum(blocks_per_seq), generator=generator)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = block_ids[start : start + n]
        start += n
    cache_shape = (sum(blocks_per_seq), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),  # unused
        cu_seqlens_q=cu_seqlens_q.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    query, key_cache, value_cache = (
        t.to(device=device, dtype=dtype) for t in (query, key_cache, value_cache)
    )
    return query, key_cache, value_cache, metadata
