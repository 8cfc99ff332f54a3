"""Engine settings, checked before any work starts (`EngineArgs` in vLLM's vocabulary)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minivllm.attention import AttentionBackend, get_backend
from minivllm.sampling_params import SEED_RANGE
from minivllm.utils import as_int

if TYPE_CHECKING:
    from minivllm.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# With no explicit num_kv_blocks, the cache gets this many bytes: 1 GiB holds ~23k tokens of
# SmolLM2 in fp32 (45 KiB per token), plenty for a laptop-sized batch.
DEFAULT_KV_CACHE_BYTES = 1 << 30

# "continuous": vLLM's token-level batching (scheduler.py). "static": request-level
# batching as servers did before it (static_scheduler.py), kept to measure the difference.
SCHEDULING_POLICIES = ("continuous", "static")


SPECULATIVE_METHODS = ("ngram",)


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}``.

    ``num_speculative_tokens`` is required. As in vLLM, if neither lookup bound is given
    both are 5; if one is given the other copies it."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @classmethod
    def from_dict(cls, options: dict) -> SpeculativeConfig:
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {options!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**options)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; "
                f"choose {', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )


@dataclass
class EngineConfig:
    """Everything `LLM` / `LLMEngine` accept besides the prompts.

    ``model=None`` means the bundled SmolLM2-135M-Instruct. ``num_kv_blocks=None`` sizes
    the cache from ``kv_cache_memory_bytes``; ``max_model_len=None`` takes the model's
    limit, capped by what the cache can hold. ``enable_prefix_caching=None`` means vLLM
    v1's default: on, unless the scheduling policy is static (which has no paged cache to
    share blocks in). ``async_scheduling=None`` means on where it overlaps real work, a CUDA
    device, and off on a CPU (`use_async_scheduling`).

    A field's ``help`` is its documentation; the command line turns every field into a
    ``--flag`` (``minivllm/entrypoints/cli_args.py``), so this module knows nothing of it.
    """

    model: str | None = field(
        default=None,
        metadata={
            "help": "local HF checkpoint, or the bundled model's Hub id "
            "(default: the bundled HuggingFaceTB/SmolLM2-135M-Instruct)"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "KV blocks (default: as many as the KV cache memory holds)"},
    )
    kv_cache_memory_bytes: int = field(
        default=DEFAULT_KV_CACHE_BYTES,
        metadata={"help": "memory for the KV cache, in bytes or a unit: 64MiB (default: 1GiB)"},
    )
    max_num_seqs: int = field(default=64, metadata={"help": "most requests in one step"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "token budget of one step (chunked prefill)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output (default: model's limit)"}
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "auto: numba-cpu on CPU when numba is installed, else torch"},
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "worker processes the model is split across (tensor parallelism)"},
    )
    dtype: str = field(default="auto", metadata={"help": "auto: float32 on CPU, bfloat16 on GPU"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    seed: int = field(default=0, metadata={"help": "seeds requests that bring no seed"})
    enable_prefix_caching: bool | None = field(
        default=None,
        metadata={
            "help": "share the KV blocks of common prompt prefixes (default: on, like vLLM v1, "
            "unless the scheduling policy is static)"
        },
    )
    share_forked_blocks: bool = field(
        default=True,
        metadata={
            "help": "beam search: a forked beam shares its parent's KV blocks, copying only "
            "a shared partial block when it writes into it (PagedAttention's copy-on-write); "
            "off: every fork copies all its parent's blocks at once, as a cache without "
            "shared paging must (kept for comparison)"
        },
    )
    scheduling_policy: str = field(
        default="continuous",
        metadata={"help": "continuous: vLLM's token-level batching; static: for comparison"},
    )
    speculative_config: SpeculativeConfig | dict | None = field(
        default=None,
        metadata={
            "help": 'speculative decoding, as JSON: \'{"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
            "(default: off)"
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "weights in fewer bytes: int8 (W8A8 dynamic, FBGEMM) or gguf (the bundled "
            "model's own Q4_1/Q8_0 blocks, numba kernel); default: none, fp32 weights"
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "schedule step N+1 while step N runs, its decodes' input tokens filled in "
            "from step N's samples (vLLM's async scheduling; default: on a CUDA device "
            "wherever it is supported: continuous policy, no speculative decoding, one "
            "process, not numba-cuda; off on a CPU, where there is nothing to overlap)"
        },
    )

    def __post_init__(self) -> None:
        positive = (
            "block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
            "tensor_parallel_size",
        )  # fmt: skip
        for name in positive:
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.seed = as_int("seed", self.seed)
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r}; "
                f"choose {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.scheduling_policy == "continuous"
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True, False or None, "
                f"got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.share_forked_blocks, bool):
            raise ValueError(
                f"share_forked_blocks must be True or False, got {self.share_forked_blocks!r}"
            )
        if self.scheduling_policy == "static" and self.enable_prefix_caching:
            raise ValueError("prefix caching needs the paged cache of the continuous policy")
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None and self.scheduling_policy == "static":
            raise ValueError("speculative decoding needs the continuous scheduling policy")
        self._check_async_scheduling()
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but torch sees no CUDA GPU")
        self._check_devices_for_ranks()
        self._check_quantization()
        # Imported here: the registry imports nothing heavy, but keep config import-light.
        from minivllm.attention import available_backends

        if self.attention_backend != "auto" and self.attention_backend not in available_backends():
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"available: auto, {', '.join(available_backends())}"
            )

    def _check_quantization(self) -> None:
        """A format this device, dtype or split cannot run is refused here, before any work
        (`minivllm.quantization.check_quantization`); "gguf" exists for the bundled model."""
        from minivllm.quantization import check_quantization

        check_quantization(
            self.quantization, self.torch_device, self.torch_dtype, self.tensor_parallel_size
        )
        if self.quantization == "gguf" and self.model is not None:
            from pathlib import Path

            from minivllm.models.model_files import HUB_ID, MODEL_NAME, cache_dir

            converted = (cache_dir() / MODEL_NAME).resolve()  # the bundled file, dequantized
            if self.model not in (HUB_ID, MODEL_NAME) and Path(self.model).resolve() != converted:
                raise ValueError(
                    f"quantization='gguf' loads the bundled {HUB_ID}'s GGUF file; model "
                    f"{self.model!r} has none (use quantization='int8' for a checkpoint)"
                )

    def _check_async_scheduling(self) -> None:
        """``async_scheduling=None`` (the default) means: on a CUDA device wherever it is
        supported; `use_async_scheduling` says what the engine does. Asked for explicitly where it
        is not supported, it is refused here, with the reason."""
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True, False or None, got {self.async_scheduling!r}"
            )
        reason = self.async_scheduling_unsupported
        if self.async_scheduling and reason is not None:
            raise ValueError(f"async_scheduling=True is not supported here: {reason}")

    @property
    def async_scheduling_unsupported(self) -> str | None:
        """Why async scheduling cannot run with these settings, or None where it can. It
        schedules a decode before its input token is known, which only the continuous
        scheduler's bookkeeping allows; draft tokens are proposed from the known tokens
        (vLLM refused them with it at first too); and the token is filled in by the model
        runner that sampled it, which tensor-parallel ranks but the first are not. The model
        then runs on the engine's step worker thread: the numba-cuda backend is left out,
        as numba's CUDA simulator keeps its simulated threads' state per Python thread and
        failed there."""
        if self.scheduling_policy != "continuous":
            return "async_scheduling needs the continuous scheduling policy"
        if self.speculative_config is not None:
            return "async_scheduling does not support speculative decoding yet"
        if self.tensor_parallel_size != 1:
            return f"async_scheduling needs tensor_parallel_size=1, got {self.tensor_parallel_size}"
        if self.attention_backend == "numba-cuda":
            return "async_scheduling is not supported with the numba-cuda attention backend"
        return None

    @property
    def async_scheduling_off(self) -> str | None:
        """Why the engine does not schedule asynchronously when ``async_scheduling`` is
        left None, or None where it does. Overlap pays where the model runs on a device
        and the CPU is free to schedule meanwhile: on CUDA. On a CPU the model's work *is*
        the CPU's work (docs/engine-overhead.md measured no gain), so the
        default is the synchronous loop the chapters teach."""
        reason = self.async_scheduling_unsupported
        if reason is None and self.torch_device.type != "cuda":
            reason = f"the model runs on {self.torch_device.type}: nothing to overlap with"
        return reason

    @property
    def use_async_scheduling(self) -> bool:
        """Whether the engine schedules asynchronously: as asked, or by default on a CUDA
        device wherever it is supported (the one place that decides; `async_scheduling_off`
        says why not). The field keeps what was asked, so that a copy with another policy
        decides again."""
        if self.async_scheduling is None:
            return self.async_scheduling_off is None
        return self.async_scheduling

    @property
    def scheduler_cls(self) -> str:
        """The scheduling policy's class, by qualified name (vLLM's
        ``SchedulerConfig.get_scheduler_cls``): the engine loads it, so the core imports
        no policy but the plain one."""
        if self.scheduling_policy == "static":  # for comparison only: static_scheduler.py
            return "minivllm.static_scheduler.StaticBatchScheduler"
        if self.speculative_config is not None:
            return "minivllm.spec_decode.scheduler.SpecDecodeScheduler"
        if self.use_async_scheduling:
            return "minivllm.async_scheduler.AsyncScheduler"
        return "minivllm.scheduler.Scheduler"

    def _check_devices_for_ranks(self) -> None:
        """On CUDA each tensor-parallel rank takes its own GPU, cuda:0 to cuda:tp-1."""
        tp = self.tensor_parallel_size
        if tp == 1 or self.torch_device.type != "cuda":
            return
        if self.device.startswith("cuda:"):
            raise ValueError(
                f"device {self.device!r} names one GPU, but tensor_parallel_size={tp} "
                f"ranks take cuda:0 .. cuda:{tp - 1}; pass device='cuda'"
            )
        if tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} CUDA devices, torch sees "
                f"{torch.cuda.device_count()}"
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


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def checked_backend(config: EngineConfig) -> type[AttentionBackend]:
    """The attention backend class ``config`` names, refused if it cannot run there."""
    backend_cls = get_backend(config.attention_backend_name)
    backend_cls.check_supported(config.torch_dtype, config.torch_device)
    if config.speculative_config is not None and not backend_cls.supports_multi_token_decode:
        raise ValueError(
            f"attention backend {backend_cls.name!r} cannot take multi-token decode "
            "queries, which speculative decoding needs; choose another backend"
        )
    return backend_cls


def resolve_max_model_len(
    config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int
) -> int:
    """``config.max_model_len``, or by default the model's limit capped by what the
    cache holds; refused if it exceeds either."""
    capacity = num_kv_blocks * config.block_size
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(limit, capacity)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's limit of {limit} positions"
        )
    if max_model_len > capacity:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the KV cache: num_kv_blocks="
            f"{num_kv_blocks} x block_size={config.block_size} = {capacity} tokens"
        )
    return max_model_len
