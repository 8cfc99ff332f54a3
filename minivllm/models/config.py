"""The model's shape, `ModelConfig`: no weights, no layers.

The loader reads it from a checkpoint's ``config.json`` (`minivllm.models.loader`), the
simulator has presets of it (`minivllm.simulator.models`), and the model is built from it
(`minivllm.models.llama`). What follows from the shape (parameters, FLOPs, KV bytes, the
tensor-parallel split) is computed in `minivllm.models.arithmetic`, which this module
does not import: arithmetic reads a config, the model reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelConfig:
    """The model's shape. Differences between the families are switches here: a bias on
    the q/k/v projections (Qwen2), an RMSNorm on each head's queries and keys (Qwen3),
    and the head dimension."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    inv_freq: torch.Tensor  # [head_dim // 2] rotary frequencies, scaling already applied
    rope_attention_scaling: float = 1.0  # cos/sin multiplier some rope types use
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama's attention_bias=True also puts a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    tie_word_embeddings: bool = False
