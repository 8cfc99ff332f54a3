"""Engine settings, checked before any work starts (`EngineArgs` in vLLM's vocabulary)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# With no explicit num_kv_blocks, the cache gets this many bytes: 1 GiB holds ~23k tokens of
# SmolLM2 in fp32 (45 KiB per token), plenty for a laptop-sized batch.
DEFAULT_KV_CACHE_BYTES = 1 << 30

# "continuous": vLLM's token-level batching (scheduler.py). "static": request-level
# batching as servers did before it (static_scheduler.py), kept to measure the difference.
SCHEDULING_POLICIES = ("continuous", "static")


@dataclass
class EngineConfig:
    """Everything `LLM` / `LLMEngine` accept besides the prompts.

    ``model=None`` means the bundled SmolLM2-135M-Instruct. ``num_kv_blocks=None`` sizes
    the cache from ``kv_cache_memory_bytes``; ``max_model_len=None`` takes the model's
    limit, capped by what the cache can hold.
    """

    model: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    attention_backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = False
    scheduling_policy: str = "continuous"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r}; "
                f"choose {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.scheduling_policy == "static" and self.enable_prefix_caching:
            raise ValueError("prefix caching needs the paged cache of the continuous policy")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA GPU")
        # Imported here: the registry imports nothing heavy, but keep config import-light.
        from minivllm.attention import available_backends

        if self.attention_backend != "auto" and self.attention_backend not in available_backends():
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"available: auto, {', '.join(available_backends())}"
            )

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            # fp32 on CPU: half-precision matmuls are slow there, and fp32 is what the
            # parity tests compare against.
            return torch.float32
        # On a GPU bf16, like vLLM, unless the chosen backend only runs fp16/fp32.
        if self.attention_backend in ("auto", "torch"):
            return torch.bfloat16
        from minivllm.attention import get_backend

        supported = get_backend(self.attention_backend).supported_dtypes
        preferred = (torch.bfloat16, torch.float16, torch.float32)
        return next((d for d in preferred if d in supported), torch.bfloat16)

    @property
    def attention_backend_name(self) -> str:
        """The backend "auto" stands for. Like vLLM, pick the fastest one for the
        platform: the numba kernel on CPU in fp32 when numba is installed, otherwise the
        torch reference (which runs everywhere)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        on_cpu_fp32 = self.torch_device.type == "cpu" and self.torch_dtype == torch.float32
        if on_cpu_fp32 and importlib.util.find_spec("numba") is not None:
            return "numba-cpu"
        return "torch"
