"""The model's arithmetic in one place: parameters, FLOPs and KV bytes, and how tensor
parallelism cuts them across ranks.

Everything that counts a model asks these functions: the executor sizing the real KV
pool, the bench's useful-work GFLOP/s, the simulator's roofline and its KV pool, and the
real sharded model (`tensor_parallel_size` workers). So a deployment the engine would
refuse is refused by the simulator with the same message, and all of them agree on what
one device holds and computes.

Conventions: 2 FLOPs per multiply-add; only matrix multiplies and attention count (norms,
rotary and activations are a rounding error next to them). With ``tp`` ranks (vLLM's
layout): query heads, the MLP's columns and the vocabulary are split evenly; KV heads
too, or replicated when there are more ranks than KV heads; norms are replicated. Every
``tp=1`` count is the whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.utils import cdiv

if TYPE_CHECKING:
    import torch

    from minivllm.models.config import ModelConfig


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


# --- parameters ----------------------------------------------------------------------


def layer_matmul_parameters(config: ModelConfig, tp: int = 1) -> int:
    """One layer's matrix weights on one rank: the fused q/k/v projection, o, and the
    SwiGLU MLP's gate, up and down."""
    c = config
    q_size = c.num_heads // tp * c.head_dim
    kv_size = kv_heads_per_rank(c.num_kv_heads, tp) * c.head_dim
    attention = c.hidden_size * (q_size + 2 * kv_size) + q_size * c.hidden_size
    mlp = 3 * c.hidden_size * cdiv(c.intermediate_size, tp)
    return attention + mlp


def layer_parameters(config: ModelConfig, tp: int = 1) -> int:
    """One layer on one rank: the matrices, their biases where the model has them, two
    RMSNorms (replicated) and Qwen3's per-head q/k norms."""
    c = config
    q_size = c.num_heads // tp * c.head_dim
    kv_size = kv_heads_per_rank(c.num_kv_heads, tp) * c.head_dim
    biases = (q_size + 2 * kv_size) * c.qkv_bias + c.hidden_size * c.o_bias
    biases += (2 * cdiv(c.intermediate_size, tp) + c.hidden_size) * c.mlp_bias
    norms = 2 * c.hidden_size + 2 * c.head_dim * c.qk_norm
    return layer_matmul_parameters(c, tp) + biases + norms


def vocab_parameters(config: ModelConfig, tp: int = 1) -> int:
    """The input embedding (and, separately, an untied LM head) on one rank: its share
    of the vocabulary's rows."""
    return cdiv(config.vocab_size, tp) * config.hidden_size


def num_parameters(config: ModelConfig, tp: int = 1) -> int:
    """Every parameter one rank holds: embedding, layers, final norm, and the LM head
    unless it is the embedding itself. ``tp=1``: the loaded model's ``numel()``."""
    c = config
    lm_head = 0 if c.tie_word_embeddings else vocab_parameters(c, tp)
    return (
        vocab_parameters(c, tp) + c.num_layers * layer_parameters(c, tp) + c.hidden_size + lm_head
    )


# --- bytes per weight: the quantization formats ------------------------------------

QUANTIZATION_METHODS = ("int8", "gguf")


@dataclass(frozen=True)
class WeightFormat:
    """Bytes one weight takes in the layers' matrices and in the vocabulary matrix
    (embedding / LM head), scales included (spread over their row or block)."""

    layer_bytes: float
    vocab_bytes: float
    description: str


def bytes_per_weight(quantization: str | None, dtype_bytes: int = 4) -> WeightFormat:
    """A format's bytes per weight, as minivllm stores it (minivllm/quantization/)."""
    if quantization is None:
        return WeightFormat(dtype_bytes, dtype_bytes, f"{8 * dtype_bytes}-bit floats")
    if quantization == "int8":
        # One int8 per weight; one fp32 scale per row of hundreds of weights is < 1 %.
        return WeightFormat(1.0, 1.0, "int8 per-channel weights, int8 per-row activations")
    if quantization == "gguf":
        # Q4_1: 16 bytes of 4-bit values + fp32 scale and minimum per 32 weights (24 / 32);
        # Q8_0: 32 bytes + an fp32 scale per 32 (36 / 32). The file has fp16 scales (20 / 32,
        # 34 / 32); minivllm widens them for numba (kernels/numba_gguf.py).
        return WeightFormat(24 / 32, 36 / 32, "GGUF Q4_1 layers, Q8_0 embedding / LM head")
    raise ValueError(
        f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATION_METHODS)} or None"
    )


def weight_bytes(
    config: ModelConfig,
    dtype_bytes: int,
    tp: int = 1,
    quantization: str | None = None,
    with_lm_head: bool = True,
    with_embedding: bool = False,
) -> int:
    """Bytes of weights on one rank: the layers (matrices in the format, norms and biases
    in ``dtype_bytes``), the final norm, and the vocabulary matrix as the LM head
    (``with_lm_head``) and, if not tied to it, as the input embedding (``with_embedding``).
    A decode step reads the layers and the LM head once; the embedding only a few rows."""
    fmt = bytes_per_weight(quantization, dtype_bytes)
    c = config
    matrices = c.num_layers * layer_matmul_parameters(c, tp)
    others = c.num_layers * (layer_parameters(c, tp) - layer_matmul_parameters(c, tp))
    total = matrices * fmt.layer_bytes + (others + c.hidden_size) * dtype_bytes
    vocab_matrices = with_lm_head + (with_embedding and not c.tie_word_embeddings)
    if with_embedding and c.tie_word_embeddings and not with_lm_head:
        vocab_matrices = 1
    total += vocab_matrices * vocab_parameters(c, tp) * fmt.vocab_bytes
    return round(total)


# --- FLOPs ---------------------------------------------------------------------------


def keys_attended(num_tokens: int, start_position: int = 0) -> int:
    """Keys the rows of a chunk attend to, summed: the row at position ``p`` sees
    ``p + 1`` keys (causal), for positions ``start_position .. + num_tokens - 1``."""
    n = num_tokens
    return n * start_position + n * (n + 1) // 2


def linear_flops(config: ModelConfig, num_rows: int, tp: int = 1) -> int:
    """Every layer's matrix multiplies for ``num_rows`` token rows, on one rank."""
    return 2 * num_rows * config.num_layers * layer_matmul_parameters(config, tp)


def attention_flops(config: ModelConfig, num_keys_attended: int, tp: int = 1) -> int:
    """q.k and p.v, 2 FLOPs each per query head, head dimension and key, every layer, on
    one rank (its share of the query heads)."""
    q_size = config.num_heads // tp * config.head_dim
    return 4 * q_size * num_keys_attended * config.num_layers


def lm_head_flops(config: ModelConfig, num_sampled: int, tp: int = 1) -> int:
    """The vocabulary projection, only for the rows a token is sampled from."""
    return 2 * config.hidden_size * cdiv(config.vocab_size, tp) * num_sampled


def forward_flops(
    config: ModelConfig, num_rows: int, num_keys_attended: int, num_sampled: int, tp: int = 1
) -> int:
    """One forward pass on one rank: ``num_rows`` rows through every layer, attention
    over ``num_keys_attended`` keys in all, the LM head for ``num_sampled`` rows."""
    return (
        linear_flops(config, num_rows, tp)
        + attention_flops(config, num_keys_attended, tp)
        + lm_head_flops(config, num_sampled, tp)
    )


def prefill_flops(config: ModelConfig, num_prompt_tokens: int, tp: int = 1) -> int:
    """A whole prompt in one pass, and its first output token sampled."""
    n = num_prompt_tokens
    return forward_flops(config, n, keys_attended(n), 1, tp)


def decode_flops(config: ModelConfig, context_len: int, tp: int = 1) -> int:
    """One decode step of one request whose context, this row included, is
    ``context_len`` tokens."""
    return forward_flops(config, 1, context_len, 1, tp)


def request_flops(config: ModelConfig, num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Floating-point operations one request needs at the least, as in model-FLOPs
    utilisation: every token but the last goes through all projections; each output
    token comes from one vocabulary projection; attention at position ``p`` reads
    ``p + 1`` keys and values. Padding and recomputation are not counted: they are
    waste, not work. Equals `prefill_flops` plus one `decode_flops` per later token."""
    num_rows = num_prompt_tokens + num_output_tokens - 1
    return forward_flops(config, num_rows, keys_attended(num_rows), num_output_tokens)


# --- KV cache ------------------------------------------------------------------------


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """One token's keys and values, every layer, on one rank (its KV heads)."""
    kv_heads = kv_heads_per_rank(config.num_kv_heads, tp)
    return 2 * config.num_layers * kv_heads * config.head_dim * dtype_bytes


def num_blocks_for_bytes(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    num_bytes: int,
    tensor_parallel_size: int = 1,
) -> int:
    """How many KV blocks ``num_bytes`` of memory hold: a block stores a key and a value
    vector per layer, KV head and token slot (`kv_bytes_per_token`); split
    across tensor-parallel ranks, only the rank's own KV heads."""
    bytes_per_block = block_size * kv_bytes_per_token(
        model_config, dtype.itemsize, tensor_parallel_size
    )
    return max(1, num_bytes // bytes_per_block)
