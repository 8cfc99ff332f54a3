"""The attention backend contract: one function signature every kernel implements.

A step's batch is *flattened*: the query rows of every scheduled sequence are stacked
into one `[num_tokens, num_heads, head_dim]` tensor, prefill chunks and decodes alike.
`AttentionMetadata` says which rows belong to which sequence and where that sequence's
keys and values live in the paged KV cache. The model runner builds it once per step;
every layer reads the same object.

Writing the new keys/values into the cache is one shared op (`write_kv_cache`), so a
backend only has to *read*: for each query row, attend causally to its own sequence's
context through the block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class AttentionMetadata:
    """Where each query row of one step comes from and where its context lives.

    Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; these are the
    *last* ``query_len`` tokens of its ``context_lens[i]`` tokens, so query row ``j`` of a
    sequence sits at position ``context_len - query_len + j`` and sees keys ``0..that``.

    All index tensors are int32 except ``slot_mapping`` (int64, it indexes a flat view of
    the whole cache). Block tables are padded on the right with block id 0; a backend
    must never read a block past ``ceil(context_len / block_size)``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    context_lens: torch.Tensor  # [num_seqs] int32: tokens attended to, new ones included
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys/values at their slots: the only write into the paged cache.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``.
    key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
    """
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class AttentionBackend(ABC):
    """Read-only paged attention over a mixed batch of prefill chunks and decodes.

    Subclasses set ``name`` (the registry key), the dtypes and device types they run on,
    and implement `forward`. The engine builds one instance with no arguments and shares
    it across every layer, so per-call state belongs in `forward`'s arguments.
    Grouped-query attention: ``num_heads`` must be a multiple of ``num_kv_heads``;
    query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    """

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]]
    supported_devices: ClassVar[tuple[str, ...]]  # torch device types: "cpu", "cuda"
    # Speculative decoding runs a decode as 1 + k query rows (causal inside the chunk). The
    # contract above already covers it; a backend with a query_len == 1 decode shortcut
    # sets this False, and the engine refuses speculative decoding with it.
    supports_multi_token_decode: ClassVar[bool] = True

    @classmethod
    def check_supported(cls, dtype: torch.dtype, device: torch.device | str) -> None:
        """Raise ValueError if this backend cannot run on ``dtype`` / ``device``."""
        device_type = torch.device(device).type
        if dtype not in cls.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            raise ValueError(
                f"attention backend {cls.name!r} does not support dtype "
                f"{str(dtype).removeprefix('torch.')}; it supports: {names}"
            )
        if device_type not in cls.supported_devices:
            raise ValueError(
                f"attention backend {cls.name!r} does not run on device {device_type!r}; "
                f"it runs on: {', '.join(cls.supported_devices)}"
            )

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output for every query row.

        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
        already holding this step's keys and values.
        Returns ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
        """
