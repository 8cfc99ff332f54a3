"""Load a local Hugging Face checkpoint into minivllm's own model.

The weights come straight from the checkpoint's safetensors files; q/k/v and gate/up
projections are concatenated into the fused matrices our model uses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from minivllm.attention import AttentionBackend
from minivllm.distributed import TensorParallelGroup
from minivllm.models.config import ModelConfig
from minivllm.models.linear import Linear
from minivllm.models.llama import CausalLM, RotaryEmbedding
from minivllm.models.model_files import find_gguf
from minivllm.quantization import get_quantization_config

# HF architecture name -> the switches that make our model that architecture.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
# Rope types whose frequencies don't depend on the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def load_hf_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {str(path)!r} is not a local Hugging Face checkpoint "
            "(no config.json there); minivllm loads local checkpoints only"
        )
    hf_config = AutoConfig.from_pretrained(path)
    architectures = hf_config.architectures or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ValueError(
            f"unsupported architecture {architectures!r} in {str(path)!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return hf_config


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, or None if it has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def model_config_from_hf(hf_config: PretrainedConfig) -> ModelConfig:
    architecture = next(a for a in hf_config.architectures if a in SUPPORTED_ARCHITECTURES)
    switches = SUPPORTED_ARCHITECTURES[architecture]
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    inv_freq, attention_scaling = _rope_frequencies(hf_config, head_dim)
    attention_bias = getattr(hf_config, "attention_bias", False)
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
        inv_freq=inv_freq,
        rope_attention_scaling=attention_scaling,
        qkv_bias=switches.get("qkv_bias", attention_bias),
        o_bias=attention_bias and architecture in ("LlamaForCausalLM", "MistralForCausalLM"),
        mlp_bias=getattr(hf_config, "mlp_bias", False),
        qk_norm=switches.get("qk_norm", False),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def _rope_frequencies(hf_config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = hf_config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # Scaled variants: reuse transformers' own formulas rather than re-deriving them.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


def load_model_config(path: str | Path) -> tuple[ModelConfig, PretrainedConfig]:
    """The model's shape as the engine runs it; no weights read."""
    hf_config = load_hf_config(path)
    config = model_config_from_hf(hf_config)
    sliding_window = getattr(hf_config, "sliding_window", None)
    if sliding_window and getattr(hf_config, "use_sliding_window", True):
        # Full attention equals sliding-window attention as long as no sequence is
        # longer than the window: the engine caps max_model_len at it.
        config.max_position_embeddings = min(config.max_position_embeddings, sliding_window)
    return config, hf_config


def load_model(
    path: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    quantization: str | None = None,
) -> tuple[CausalLM, PretrainedConfig]:
    """Build our model for the checkpoint at ``path`` and fill it with its weights (with
    ``tp``, this rank's slice of them). ``quantization`` (`minivllm.quantization`): every
    linear layer gets that format's method; "int8" quantizes the loaded fp32 weights,
    "gguf" loads the bundled GGUF file's blocks instead of the fp32 matrices."""
    config, hf_config = load_model_config(path)
    quant_config = get_quantization_config(quantization)
    with torch.device("meta"):  # no memory, no random init: the checkpoint fills it
        model = CausalLM(config, backend, tp).to(dtype).eval()
        if quant_config is not None:
            for module in model.modules():
                if isinstance(module, Linear):
                    module.quant_method = quant_config.get_linear_method(module)
                    if quantization == "gguf":  # no fp32 matrix: its blocks come from the
                        # GGUF file (load_gguf_weights), so to_empty allocates nothing here
                        module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            model.tie_weights()
    model.to_empty(device=device)
    model.tie_weights()  # to_empty made new parameters, untying them
    # Computed, not loaded: build it for real.
    model.rotary = RotaryEmbedding(config).to(device=device, dtype=dtype)
    if quantization == "gguf":
        from minivllm.quantization.gguf import load_gguf_weights

        load_gguf_weights(model, find_gguf())
    else:
        _load_weights(model, Path(path), config)
    model.process_weights_after_loading()
    return model, hf_config


def _load_weights(model: CausalLM, path: Path, config: ModelConfig) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(path)!r}")
    stored: dict[str, tuple[Path, str]] = {}  # our name -> (file, name in the file)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                stored[name.removeprefix("model.")] = (file, name)

    def take(name: str) -> torch.Tensor:
        # One tensor at a time, from a file opened for it alone: safetensors maps the
        # file into memory, and the pages read stay counted in this process's resident
        # memory until the file is closed, so a file held open through the whole load
        # would add a second full copy of the model to the peak.
        if name not in stored:
            raise ValueError(f"checkpoint {str(path)!r} has no weight {name!r}")
        file, stored_name = stored.pop(name)
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(stored_name)

    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def put(name: str, tensor: torch.Tensor) -> None:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "shard"):  # a tensor-parallel layer: this rank's slice only
            tensor = module.shard(param_name, tensor)
            if tensor is None:  # a row-parallel bias, which rank 0 alone adds
                return
        target = params[name]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)

    put("embed_tokens.weight", take("embed_tokens.weight"))
    if config.tie_word_embeddings:
        # Prepack the tied matrix now: prepacking holds it twice for a moment, and that
        # moment sets the peak memory unless it comes before the other weights are in.
        model.lm_head.process_weights_after_loading()
        model.tie_weights()
        params = dict(model.named_parameters())  # without the plain matrix, now freed
    put("norm.weight", take("norm.weight"))
    if not config.tie_word_embeddings:
        put("lm_head.weight", take("lm_head.weight"))
    for i in range(config.num_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        put(
            ours + "self_attn.qkv_proj.weight",
            torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]),
        )
        if config.qkv_bias:
            put(
                ours + "self_attn.qkv_proj.bias",
                torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]),
            )
        put(ours + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
        if config.o_bias:
            put(ours + "self_attn.o_proj.bias", take(attn + "o_proj.bias"))
        if config.qk_norm:
            put(ours + "self_attn.q_norm.weight", take(attn + "q_norm.weight"))
            put(ours + "self_attn.k_norm.weight", take(attn + "k_norm.weight"))
        mlp = hf + "mlp."
        put(
            ours + "mlp.gate_up_proj.weight",
            torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
        )
        if config.mlp_bias:
            put(
                ours + "mlp.gate_up_proj.bias",
                torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")]),
            )
        put(ours + "mlp.down_proj.weight", take(mlp + "down_proj.weight"))
        if config.mlp_bias:
            put(ours + "mlp.down_proj.bias", take(mlp + "down_proj.bias"))
        put(ours + "input_layernorm.weight", take(hf + "input_layernorm.weight"))
        put(ours + "post_attention_layernorm.weight", take(hf + "post_attention_layernorm.weight"))
    missing = set(params) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        stored.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} left model weights unset: {sorted(missing)}")
    unused = [n for n in stored if "rotary_emb" not in n]
    if unused:
        raise ValueError(
            f"checkpoint {str(path)!r} has weights the model doesn't use: {unused[:5]}"
        )
