"""The tensor-parallel layers' arithmetic, one rank at a time in one process: the
column-parallel slices put side by side, and the row-parallel partials summed, are the
whole layer's output; KV heads are split or replicated as vLLM does; the vocabulary slices
(padded when tp does not divide it) give back the whole embedding and logits. The real
collectives run in tests/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minivllm.distributed import TensorParallelGroup
from minivllm.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class OneRankView(TensorParallelGroup):
    """Rank ``rank`` of ``size`` without a process group: the collectives hand back this
    rank's own part, and the test combines the parts itself."""

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x):
        return x


def loaded(layer: nn.Module, **full: torch.Tensor) -> nn.Module:
    """``layer`` with this rank's slice of each full tensor, as the loader puts it."""
    with torch.no_grad():
        for name, tensor in full.items():
            part = layer.shard(name, tensor)
            if part is not None:
                getattr(layer, name).copy_(part)
    return layer


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row_parallel_equal_the_whole_mlp(tp):
    torch.manual_seed(0)
    hidden, inter, rows = 8, 16, 3
    gate_up, down = torch.randn(2 * inter, hidden), torch.randn(hidden, inter)
    down_bias, x = torch.randn(hidden), torch.randn(rows, hidden)
    g, u = (x @ gate_up.T).split(inter, dim=-1)
    expected = (torch.nn.functional.silu(g) * u) @ down.T + down_bias
    partials = []
    for rank in range(tp):
        group = OneRankView(rank, tp)
        col = loaded(ColumnParallelLinear(hidden, [inter, inter], False, group), weight=gate_up)
        row = loaded(RowParallelLinear(inter, hidden, True, group), weight=down, bias=down_bias)
        g, u = col(x).split(inter // tp, dim=-1)
        partials.append(row(torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(sum(partials), expected)  # the all-reduce's sum


@pytest.mark.parametrize(("num_kv_heads", "tp", "kv_heads_of_ranks"), [
    (2, 2, [[0], [1]]),
    (4, 2, [[0, 1], [2, 3]]),
    (2, 4, [[0], [0], [1], [1]]),  # more ranks than KV heads: each replicated on two
    (3, 3, [[0], [1], [2]]),  # SmolLM2: 9 query heads, 3 KV heads
])  # fmt: skip
def test_qkv_rows_are_the_ranks_query_heads_and_the_kv_heads_they_read(
    num_kv_heads, tp, kv_heads_of_ranks
):
    head_dim, num_heads = 2, 12 if num_kv_heads != 3 else 9
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    # Row i of the fused weight holds the value i: the rows a rank keeps name themselves.
    weight = torch.arange(q_rows + 2 * kv_rows, dtype=torch.float32)[:, None].repeat(1, 4)
    for rank, kv_heads in enumerate(kv_heads_of_ranks):
        layer = QKVParallelLinear(4, head_dim, num_heads, num_kv_heads, False,
                                  OneRankView(rank, tp))  # fmt: skip
        kept = layer.shard("weight", weight)[:, 0].long().tolist()
        per_rank = num_heads // tp * head_dim
        q = list(range(rank * per_rank, (rank + 1) * per_rank))
        kv = [h * head_dim + d for h in kv_heads for d in range(head_dim)]
        assert kept == q + [q_rows + r for r in kv] + [q_rows + kv_rows + r for r in kv]
        # Every query head of the rank reads a KV head the rank holds: GQA's grouping.
        group_size = num_heads // num_kv_heads
        assert {(rank * (num_heads // tp) + i) // group_size
                for i in range(num_heads // tp)} <= set(kv_heads)  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 3])  # 10 tokens: 3 ranks get 4, 4 and 2 (+2 padding)
def test_vocabulary_slices_give_back_the_embedding_and_the_logits(tp):
    torch.manual_seed(0)
    vocab, hidden = 10, 4
    table, ids = torch.randn(vocab, hidden), torch.tensor([0, 3, 4, 9, 7])
    hidden_states = torch.randn(2, hidden)
    embedded, logit_slices = 0, []
    for rank in range(tp):
        group = OneRankView(rank, tp)
        embedded = embedded + loaded(VocabParallelEmbedding(vocab, hidden, group), weight=table)(
            ids
        )
        head = loaded(ParallelLMHead(hidden, vocab, group), weight=table)
        logit_slices.append(nn.Linear.forward(head, hidden_states))  # before the gather
    torch.testing.assert_close(embedded, table[ids])  # the all-reduce's sum
    logits = torch.cat(logit_slices, dim=-1)[:, :vocab]  # the gather, padding dropped
    torch.testing.assert_close(logits, hidden_states @ table.T)
