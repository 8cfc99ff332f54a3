"""What the engine's front end knows about the model: its shape, tokenizer and EOS ids.

Input processing needs the vocabulary size (to refuse bad token ids) and the tokenizer;
output processing needs the tokenizer and the end-of-sequence ids. None of it needs the
weights, so the engine reads it from the checkpoint's config and tokenizer files itself
(as vLLM's front end does), and the executor, which may live in other processes, only
executes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minivllm.models.config import ModelConfig
from minivllm.models.loader import load_model_config, load_tokenizer


@dataclass
class ModelInfo:
    model_config: ModelConfig  # vocabulary, layers, heads, ... (no weights)
    tokenizer: object | None  # the Hugging Face tokenizer, or None: token-id prompts only
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, model_path: str | Path) -> ModelInfo:
        """Read the checkpoint's config, tokenizer and generation config; no weights."""
        model_config, hf_config = load_model_config(model_path)
        tokenizer = load_tokenizer(model_path)
        return cls(model_config, tokenizer, _eos_token_ids(model_path, hf_config, tokenizer))


def _eos_token_ids(model_path, hf_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from the generation config (may be several) and the tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
