"""Tiny, randomly initialised Hugging Face checkpoints for fast tests, and HF references."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TINY_VOCAB = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]  # 256 tokens


def make_tiny_tokenizer():
    """A word-level tokenizer over "w0 .. w252": decoding is exact and predictable."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_tiny_checkpoint(path: Path, architecture: str = "llama", seed: int = 0) -> Path:
    """Save a 2-layer random model of ``architecture`` with a tokenizer at ``path``."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=len(TINY_VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        # A large init makes logits peaked, so greedy argmax is far from ties and
        # parity failures mean real bugs, not float noise.
        initializer_range=0.5,
        tie_word_embeddings=architecture != "llama",
    )
    config_cls, model_cls, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {"rope_theta": 10000.0}),
        # A sliding window wider than any test sequence: full attention, as minivllm does.
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 1024}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    }[architecture]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra))
    if architecture == "qwen2":  # random biases, so a dropped bias shows up
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


# The tiny chat model the server tests serve (conftest.py's `server`), and its settings.
MODEL_NAME = "tiny"
ENGINE_OPTIONS = dict(
    num_kv_blocks=128,
    block_size=4,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    attention_backend="torch",  # no kernel compile on the first request
)
# A template with words the tiny tokenizer knows ("<s>" and "wN"), so chat works too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<s>{% endif %}"
)


def make_tiny_chat_checkpoint(path: Path, chat_template: str) -> Path:
    """`make_tiny_checkpoint` (llama) whose tokenizer has ``chat_template``: the chat route
    needs one, and the tiny word-level tokenizer has none of its own."""
    from transformers import AutoTokenizer

    make_tiny_checkpoint(path, "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, process, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200; fail with the server's output if its
    ``process`` (a `subprocess.Popen`) exits first, or after ``timeout_s`` seconds."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, run alone (no padding).

    A plain argmax loop over the HF model and its own KV cache, rather than ``generate``:
    ``generate`` would stop at EOS or, told not to, ban EOS outright, while minivllm's
    ``ignore_eos`` samples EOS like any token and keeps going."""
    generated: list[int] = []
    ids = torch.tensor([prompt_token_ids])
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, cache=past, use_cache=True)
            past = out.cache
            next_token = int(out.logits[0, -1].argmax())
            generated.append(next_token)
            ids = torch.tensor([[next_token]])
    return generated
