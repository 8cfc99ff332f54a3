"""Layers split across tensor-parallel ranks, the Megatron way (vLLM's
``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``).

A linear layer ``y = x W^T`` can be cut two ways. *Column-parallel*: each rank holds some
output features (rows of ``W``) and computes its slice of ``y`` from the whole ``x``; no
communication. *Row-parallel*: each rank holds some input features (columns of ``W``),
multiplies its slice of ``x`` by them and gets a partial ``y``; an all-reduce sums the
partials. A column-parallel layer followed by a row-parallel one needs exactly one
all-reduce: attention (q/k/v by heads, then ``o_proj``) and the MLP (gate/up, then
``down_proj``) are each such a pair. The vocabulary is split by rows too: the embedding
all-reduces (each rank knows only its tokens), the LM head gathers its logits on rank 0.

Each layer's ``shard(param_name, full)`` picks this rank's part of a checkpoint tensor;
the loader calls it. With one rank every layer is the plain layer and ``shard`` returns
the tensor whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import TensorParallelGroup
from minivllm.models.arithmetic import kv_heads_per_rank
from minivllm.models.linear import Linear, weight_rows
from minivllm.utils import cdiv


def even_share(size: int, tp: TensorParallelGroup) -> slice:
    """The rows of a ``size``-row tensor that rank ``tp.rank`` of ``tp.size`` holds."""
    if size % tp.size:
        raise ValueError(f"{size} features cannot be split evenly across {tp.size} ranks")
    share = size // tp.size
    return slice(tp.rank * share, (tp.rank + 1) * share)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; ``output_sizes`` lists the checkpoint's fused
    outputs (q, k, v or gate, up), and each rank takes its share of every one of them,
    so the rank's output is still "its q, its k, its v" back to back."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TensorParallelGroup,
        shares: list[slice] | None = None,  # rows of each output this rank holds
    ) -> None:
        shares = shares or [even_share(size, tp) for size in output_sizes]
        super().__init__(input_size, sum(s.stop - s.start for s in shares), bias=bias)
        self.output_sizes, self.shares, self.tp = output_sizes, shares, tp

    def shard(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return full
        outputs = full.split(self.output_sizes, dim=0)
        return torch.cat([out[rows] for out, rows in zip(outputs, self.shares)])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v split by heads: rank r computes its ``num_heads / tp`` query heads and
    the KV heads they read. With more ranks than KV heads, each KV head is replicated
    on ``tp / num_kv_heads`` ranks (as vLLM does) so that every rank has one."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
    ) -> None:
        self.num_heads_per_rank = num_heads // tp.size
        self.num_kv_heads_per_rank = kv_heads_per_rank(num_kv_heads, tp.size)
        first_kv_head = tp.rank * num_kv_heads // tp.size  # whose heads rank r's queries read
        kv_rows = slice(
            first_kv_head * head_dim, (first_kv_head + self.num_kv_heads_per_rank) * head_dim
        )
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size, [q_size, kv_size, kv_size], bias, tp,
            shares=[even_share(q_size, tp), kv_rows, kv_rows],
        )  # fmt: skip


class RowParallelLinear(Linear):
    """Input features split across ranks; an all-reduce sums the partial outputs. The
    bias is added once, by rank 0, before the sum."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup
    ) -> None:
        self.columns = even_share(input_size, tp)
        super().__init__(input_size // tp.size, output_size, bias=bias and tp.rank == 0)
        self.tp = tp

    def shard(self, param_name: str, full: torch.Tensor) -> torch.Tensor | None:
        if self.tp.size == 1:
            return full
        if param_name == "bias":
            return full if self.tp.rank == 0 else None  # None: this rank holds no bias
        return full[:, self.columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))  # partial sums -> the whole product


def vocab_share(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first token id, rows) of rank ``tp.rank``'s vocabulary slice; the last slice is
    padded with zero rows when ``tp.size`` does not divide the vocabulary."""
    rows = cdiv(vocab_size, tp.size)
    return tp.rank * rows, rows


def shard_vocab_rows(full: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    start, rows = vocab_share(full.shape[0], tp)
    part = full[start : start + rows]
    return F.pad(part, (0, 0, 0, rows - part.shape[0]))  # zero rows past the vocabulary


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds the embeddings of a slice of the vocabulary; a token outside it
    gets zeros there, and the all-reduce adds the one rank's real row. Tied to the LM
    head, the weight is the head's, perhaps prepacked: rows are read from it in place."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_start, rows = vocab_share(vocab_size, tp)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def shard(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.tp.size == 1 else shard_vocab_rows(full, self.tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return weight_rows(self.weight, input_ids)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.num_embeddings)
        hidden = weight_rows(self.weight, local_ids.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(hidden.masked_fill(elsewhere[:, None], 0))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """The state dict holds the ordinary row-major matrix, prepacked or not."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_mkldnn:
            destination[prefix + "weight"] = self.weight.to_dense()


class ParallelLMHead(Linear):
    """The vocabulary projection split like the embedding: each rank computes the logits
    of its slice of the vocabulary, and rank 0 gathers them all (it samples)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        super().__init__(hidden_size, vocab_share(vocab_size, tp)[1], bias=False)
        self.vocab_size, self.tp = vocab_size, tp

    def shard(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.tp.size == 1 else shard_vocab_rows(full, self.tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n, vocab_size]`` on rank 0; None on the other ranks."""
        logits = super().forward(hidden)
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_to_first(logits)
        return None if logits is None else logits[:, : self.vocab_size]  # drop padding
