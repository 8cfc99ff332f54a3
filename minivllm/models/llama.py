"""The Llama family (Llama, SmolLM, Mistral-style) and Qwen2 / Qwen3, in one readable model.

Differences between the families are three switches in `ModelConfig`: a bias on the
q/k/v projections (Qwen2), an RMSNorm on each head's queries and keys (Qwen3), and the
head dimension. Unlike a Hugging Face model, this one sees no batch dimension and no
padding: its input is the step's flattened tokens ``[num_tokens]`` with their positions,
and attention goes through the paged KV cache via `AttentionMetadata`. The projections are
`Linear` layers (`minivllm/models/linear.py`): ``nn.Linear`` whose weight, on CPU, is
prepacked for oneDNN's GEMM once the checkpoint is loaded, which keeps decode's few-row
matmuls near memory speed. Each weight is held once, the tied embedding included. Split
across tensor-parallel ranks they are the column- and row-parallel layers of
`minivllm/models/parallel_layers.py`; with one rank those are exactly the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention import AttentionBackend, AttentionMetadata, write_kv_cache
from minivllm.distributed import TensorParallelGroup
from minivllm.models.config import ModelConfig
from minivllm.models.linear import Linear
from minivllm.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers computes x * rsqrt(mean(x^2) + eps) in fp32, then the weight in the
        # input dtype; torch's fused rms_norm gives the same bits in fp32 in one op.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates query/key pairs by position-dependent angles (RoPE, "rotate half" layout).

    Rotating half means ``x * cos + cat(-x2, x1) * sin`` (x1, x2: the two halves of a head).
    The table stores ``sin`` with its first half negated, so the rotation is
    ``x * cos + roll(x, half) * signed_sin``: the same products bit for bit (a sign flip is
    exact), three ops instead of five per layer (`apply_rotary`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = config.inv_freq.float()
        positions = torch.arange(config.max_position_embeddings, device=inv_freq.device).float()
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        scale = config.rope_attention_scaling
        sin = angles.sin() * scale
        half = sin.shape[-1] // 2
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("signed_sin", torch.cat([-sin[:, :half], sin[:, half:]], -1),
                             persistent=False)  # fmt: skip

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin for each token, ``[num_tokens, 1, head_dim]``: looked up once
        per step, for every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        return cos, self.signed_sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, with rotate_half(x) * sin as
    ``roll(x, half) * signed_sin`` (`RotaryEmbedding`)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """Multi-head attention over this rank's heads: ``num_heads / tp`` query heads and
    the KV heads they read (all of them with one rank)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # q, k and v projections fused into one matmul, cut by heads across ranks.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            config.qkv_bias, tp,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.q_size = self.num_heads * self.head_dim
        # Each rank's heads give part of o_proj's input: partial sums, then all-reduced.
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_bias, tp
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # [num_tokens, num_heads + 2 * num_kv_heads, head_dim]: query heads, key heads, values.
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        qk, v = qkv[:, : -self.num_kv_heads], qkv[:, -self.num_kv_heads :]
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Queries and keys turn by the same angles: one rotation for both.
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache  # each [num_blocks, block_size, kv_heads, head_dim]
        write_kv_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = self.backend.forward(q.contiguous(), key_cache, value_cache, metadata, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        # gate and up projections fused into one matmul; each rank holds 1/tp of the
        # intermediate features, and down_proj sums the ranks' partial outputs.
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, tp
        )
        self.intermediate_size = size // tp.size
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place, into the projection's own output: no new tensor per op.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, rope, hidden, kv_cache, metadata):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """Token ids in, next-token logits out, for a flattened batch of sequences.

    ``tp``: this process's rank among the tensor-parallel workers; the model then holds
    its slice of every projection and of the vocabulary (models/parallel_layers.py), and
    only rank 0 gets logits. The default, one rank, is the whole model."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, tp) for _ in range(config.num_layers)
        )
        self.rotary = RotaryEmbedding(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Small models reuse the input embedding as the output projection: one Parameter,
        the LM head's, which the embedding reads its rows from, prepacked or not."""
        if self.config.tie_word_embeddings:
            self.lm_head.tied = True
            self.embed_tokens.weight = self.lm_head.weight

    def process_weights_after_loading(self, prepack: bool = True) -> None:
        """Once the checkpoint is in: prepack every projection for the CPU GEMM where this
        machine can (see `minivllm.models.linear`); ``prepack=False`` goes back to F.linear."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading(prepack)
        self.tie_weights()  # the LM head has a new weight: the embedding takes it too

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A state dict holds plain matrices: load them into the plain model, then prepack
        again if it was (the tied weight goes back to one plain Parameter meanwhile)."""
        prepacked = any(m.is_prepacked for m in self.modules() if isinstance(m, Linear))
        self.process_weights_after_loading(prepack=False)
        result = super().load_state_dict(state_dict, strict, assign)
        if prepacked:
            self.process_weights_after_loading()
        return result

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden_size]``."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(rope, hidden, kv_cache, metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[n, hidden_size]`` -> ``[n, vocab_size]``, only for rows we sample from; None
        on a tensor-parallel rank other than 0."""
        return self.lm_head(hidden)
