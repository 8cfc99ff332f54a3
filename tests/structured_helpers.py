"""A tiny checkpoint whose tokenizer has one token per byte, for structured outputs: the
word-level tokenizer of helpers.py cannot spell JSON, this one can spell anything."""

from __future__ import annotations

from pathlib import Path

import torch

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>{% endif %}"
)


def make_byte_tokenizer():
    """Byte-level BPE with no merges: ``<unk> <s> </s>`` then the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def make_byte_checkpoint(path: Path, seed: int = 0, vocab_size: int = 272) -> Path:
    """A 2-layer random llama over the byte tokenizer; ``vocab_size`` above the
    tokenizer's 259 tokens, as real models pad theirs (those rows are never allowed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, initializer_range=0.5, rope_theta=10000.0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    make_byte_tokenizer().save_pretrained(path)
    return path
