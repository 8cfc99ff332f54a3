"""Model shapes for the simulator: what the cost model needs to know, no weights.

The figures are the models' Hugging Face ``config.json`` values (sources in the docs
chapter "What a GPU would do"). A `ModelShape` also turns into the engine's own
`ModelConfig`, so that the real scheduler and engine run on it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.models.llama import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama / Qwen3 layout: GQA attention, SwiGLU MLP)."""

    name: str
    hf_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on queries and keys

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's matrix multiplies: q, k, v, o and the SwiGLU MLP."""
        attention = self.hidden_size * (2 * self.q_size + 2 * self.kv_size)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attention + mlp

    @property
    def layer_params(self) -> int:
        """One layer's parameters: the matrices, two RMSNorms (and Qwen3's q/k norms)."""
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.layer_linear_params + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Everything: embedding, layers, final norm, and the LM head unless it is tied."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return (
            self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + lm_head
        )

    def to_model_config(self) -> ModelConfig:
        """The engine's `ModelConfig` of this shape (rotary frequencies are never used)."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=1e-6,
            max_position_embeddings=self.max_position_embeddings,
            inv_freq=torch.zeros(self.head_dim // 2),
            qk_norm=self.qk_norm,
            tie_word_embeddings=self.tie_word_embeddings,
        )


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape(
            "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        ModelShape(
            "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        ),
        ModelShape(
            "qwen3-8b", "Qwen/Qwen3-8B",
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
            num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
            qk_norm=True,
        ),
        ModelShape(
            "llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct",
            vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
            num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        ),
    ]
}  # fmt: skip


def get_model(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def shape_of(name: str, config: ModelConfig) -> ModelShape:
    """The shape of a loaded model (e.g. a test checkpoint), to simulate it."""
    return ModelShape(
        name,
        "local",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        qk_norm=config.qk_norm,
    )
