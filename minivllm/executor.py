"""The executor: everything that runs the model, behind one method (vLLM's ``Executor``).

The engine hands it a `SchedulerOutput` and gets back the sampled tokens. Behind that
seam sit model and tokenizer loading, the attention backend, the KV cache's size and the
`ModelRunner`. Anything with the same attributes and ``execute_model`` can stand in: a fake
executor in the tests, a cost-model executor in the simulator.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.attention import get_backend
from minivllm.config import EngineConfig
from minivllm.model_runner import ModelRunner
from minivllm.models import arithmetic
from minivllm.models.llama import ModelConfig
from minivllm.models.loader import load_model, load_tokenizer
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput


class Executor(Protocol):
    model_config: ModelConfig  # the model's shape: vocabulary, layers, heads, ...
    num_kv_blocks: int  # blocks in the KV cache
    max_model_len: int  # longest request (prompt + output) it accepts
    eos_token_ids: frozenset[int]
    device: torch.device  # where per-request sampling generators live

    def get_tokenizer(self):
        """The Hugging Face tokenizer, or None (then prompts must be token ids)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: compute every scheduled chunk, sample where asked."""


class UniProcExecutor:
    """The real thing, in this process: the model on one device (CPU or one GPU)."""

    def __init__(self, config: EngineConfig) -> None:
        self.device, dtype = config.torch_device, config.torch_dtype
        backend_cls = get_backend(config.attention_backend_name)
        backend_cls.check_supported(dtype, self.device)
        if config.speculative_config is not None and not backend_cls.supports_multi_token_decode:
            raise ValueError(
                f"attention backend {backend_cls.name!r} cannot take multi-token decode "
                "queries, which speculative decoding needs; choose another backend"
            )
        model_path = config.model
        if model_path is None:
            from minivllm.models.model_files import default_model_path

            model_path = default_model_path()
        self.model, hf_config = load_model(model_path, backend_cls(), dtype, self.device)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(model_path)
        self.eos_token_ids = _eos_token_ids(model_path, hf_config, self.tokenizer)

        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_bytes(
            self.model_config, config.block_size, dtype, config.kv_cache_memory_bytes
        )
        self.max_model_len = resolve_max_model_len(config, self.model_config, self.num_kv_blocks)
        self.model_runner = ModelRunner(
            self.model, self.num_kv_blocks, config.block_size, dtype, self.device,
            self.eos_token_ids,
        )  # fmt: skip

    def get_tokenizer(self):
        return self.tokenizer

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)


def num_blocks_for_bytes(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, num_bytes: int
) -> int:
    """How many KV blocks ``num_bytes`` of memory hold: a block stores a key and a value
    vector per layer, KV head and token slot (`arithmetic.kv_bytes_per_token`)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    bytes_per_block = block_size * arithmetic.kv_bytes_per_token(model_config, element_size)
    return max(1, num_bytes // bytes_per_block)


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
