"""The reference backend: plain torch, one sequence at a time. The simplest code to trust;
every other backend is property-tested equal to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's keys/values through its block table, then runs SDPA."""

    name = "torch"
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_devices = ("cpu", "cuda")

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        block_size = key_cache.shape[1]
        output = torch.empty_like(query)
        starts = metadata.cu_seqlens_q.tolist()
        context_lens = metadata.context_lens.tolist()
        for i, context_len in enumerate(context_lens):
            start, end = starts[i], starts[i + 1]
            num_blocks = -(-context_len // block_size)
            blocks = metadata.block_tables[i, :num_blocks].long()
            # [num_blocks, block_size, kv_heads, dim] -> [context_len, kv_heads, dim]
            key = key_cache[blocks].flatten(0, 1)[:context_len]
            value = value_cache[blocks].flatten(0, 1)[:context_len]
            output[start:end] = _causal_attention(query[start:end], key, value, scale)
        return output


def _causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """query ``[q_len, heads, dim]`` are the last q_len of key/value's ``[ctx, kv_heads, dim]``."""
    query_len, context_len = query.shape[0], key.shape[0]
    query_positions = torch.arange(context_len - query_len, context_len, device=query.device)
    key_positions = torch.arange(context_len, device=query.device)
    visible = key_positions[None, :] <= query_positions[:, None]  # [q_len, ctx]
    # Compute in fp32 whatever the cache dtype: the reference should be the exact one.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).float(),
        key.transpose(0, 1).float(),
        value.transpose(0, 1).float(),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(query.dtype)
