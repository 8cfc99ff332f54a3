"""The model's arithmetic in one place: how a model is cut across tensor-parallel ranks.

The real sharded model (`tensor_parallel_size` workers) and the simulator's cost model
both ask these functions, so a deployment the engine would refuse is refused by the
simulator with the same message, and both agree on what one device holds.
"""

from __future__ import annotations


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> None:
    """Refuse a split vLLM refuses: every rank takes the same number of query heads, and
    KV heads either divide evenly across ranks or each rank holds whole copies of them
    (more ranks than KV heads, a multiple of them)."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if num_heads % tp != 0:
        raise ValueError(
            f"the model's {num_heads} attention heads must be divisible by "
            f"tensor_parallel_size={tp}"
        )
    if num_kv_heads % tp != 0 and tp % num_kv_heads != 0:
        raise ValueError(
            f"the model's {num_kv_heads} KV heads must be divisible by "
            f"tensor_parallel_size={tp}, or tensor_parallel_size a multiple of them"
        )


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one rank holds: an even share, or one replicated head when there are more
    ranks than KV heads (as vLLM replicates them)."""
    return max(1, num_kv_heads // tensor_parallel_size)
