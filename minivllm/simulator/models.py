"""Model presets for the simulator: the engine's own `ModelConfig`, no weights.

The figures are the models' Hugging Face ``config.json`` values (sources in the docs
chapter "What a GPU would do"). Everything the cost model derives from them (parameters,
FLOPs, KV bytes, the tensor-parallel split) comes from `minivllm.models.arithmetic`, the
same functions the real engine and the bench use.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from minivllm.models.config import ModelConfig


def _preset(head_dim: int, **shape) -> ModelConfig:
    """A `ModelConfig` of this shape. The simulator never rotates a query, so the rotary
    frequencies are placeholders; the norm epsilon is never used either."""
    return ModelConfig(
        head_dim=head_dim, rms_norm_eps=1e-6, inv_freq=torch.zeros(head_dim // 2), **shape
    )


MODELS: dict[str, ModelConfig] = {
    "smollm2-135m": _preset(  # HuggingFaceTB/SmolLM2-135M-Instruct
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": _preset(  # meta-llama/Llama-3.1-8B-Instruct
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
    ),
    "qwen3-8b": _preset(  # Qwen/Qwen3-8B
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        qk_norm=True,
    ),
    "llama-3.1-70b": _preset(  # meta-llama/Llama-3.1-70B-Instruct
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
    ),
}  # fmt: skip


def get_model(name: str) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def preset_name(config: ModelConfig) -> str:
    """The preset's name, or ``custom`` for any other `ModelConfig` (a loaded checkpoint's)."""
    return next((name for name, preset in MODELS.items() if preset is config), "custom")


def shape_json(config: ModelConfig) -> dict:
    """The shape as JSON: every field but the rotary frequencies."""
    shape = asdict(config)
    del shape["inv_freq"]
    return {"name": preset_name(config), **shape}
