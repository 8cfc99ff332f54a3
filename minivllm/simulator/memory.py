"""How many KV blocks fit on a device, sized the way vLLM does it.

vLLM's worker may use ``gpu_memory_utilization`` of the device's total memory. It loads
the weights, runs one dummy forward pass of ``max_num_batched_tokens`` tokens to measure
the activation peak, and gives everything left to the KV cache, in blocks:

    KV bytes = memory x utilisation - weights - activation peak
    blocks   = KV bytes // (bytes of one block of keys and values, all layers)

Here the activation peak is estimated from the model's shape instead of measured (see
`activation_bytes`); vLLM also subtracts memory outside torch (CUDA context, NCCL
buffers), which this leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.models import arithmetic
from minivllm.models.config import ModelConfig
from minivllm.simulator.hardware import Hardware


def activation_bytes(
    model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int, tp: int
) -> int:
    """The largest step's live activations on one device: per token the residual stream
    and its normed copy, q/k/v, the attention output and the MLP's gate, up and product;
    plus fp32 logits for the rows that sample (at most ``max_num_seqs``)."""
    q_size = model.num_heads // tp * model.head_dim
    kv_size = arithmetic.kv_heads_per_rank(model.num_kv_heads, tp) * model.head_dim
    per_token = (
        2 * model.hidden_size + q_size + 2 * kv_size + q_size + 3 * model.intermediate_size // tp
    )
    logits = min(max_num_batched_tokens, max_num_seqs) * model.vocab_size * 4
    return max_num_batched_tokens * per_token * dtype_bytes + logits


@dataclass(frozen=True)
class KVPoolSizing:
    """Each number of the computation, in bytes, for one device."""

    budget: int  # memory x utilisation
    weights: int
    activations: int
    block_bytes: int
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.weights - self.activations


def size_kv_pool(
    model: ModelConfig,
    hardware: Hardware,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    tp: int = 1,
    quantization: str | None = None,
) -> KVPoolSizing:
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    dtype_bytes = hardware.dtype_bytes
    budget = int(hardware.memory_bytes * gpu_memory_utilization)
    weights = arithmetic.weight_bytes(model, dtype_bytes, tp, quantization, with_embedding=True)
    activations = activation_bytes(model, max_num_batched_tokens, max_num_seqs, dtype_bytes, tp)
    block_bytes = block_size * arithmetic.kv_bytes_per_token(model, dtype_bytes, tp)
    num_blocks = max(0, (budget - weights - activations) // block_bytes)
    return KVPoolSizing(budget, weights, activations, block_bytes, num_blocks)
