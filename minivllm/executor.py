"""The executor: everything that runs the model, behind one method (vLLM's ``Executor``).

The engine hands it a `SchedulerOutput` and gets back the sampled tokens. Behind that
seam sit model loading, the attention backend, the KV cache's size and the `ModelRunner`,
in this process (`UniProcExecutor`) or split across worker processes
(`MultiprocExecutor`, tensor parallelism). The tokenizer and EOS ids are the engine's
(input and output processing): an executor only executes. Anything with the same
attributes, ``execute_model`` and ``shutdown`` can stand in: a fake executor in the
tests, a cost-model executor in the simulator.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.attention import AttentionBackend, get_backend
from minivllm.config import EngineConfig
from minivllm.model_runner import ModelRunner
from minivllm.models import arithmetic
from minivllm.models.llama import ModelConfig
from minivllm.models.loader import load_model
from minivllm.models.model_files import resolve_model_path
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput


class Executor(Protocol):
    num_kv_blocks: int  # blocks in the KV cache
    max_model_len: int  # longest request (prompt + output) it accepts
    device: torch.device  # where per-request sampling generators live

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: compute every scheduled chunk, sample where asked."""

    def shutdown(self) -> None:
        """Release what it holds (worker processes); later steps are refused."""


def make_executor(config: EngineConfig, eos_token_ids: frozenset[int]) -> Executor:
    """The model in this process, or split across ``tensor_parallel_size`` worker
    processes (vLLM's ``Executor.get_class``). ``eos_token_ids``: what the sampler masks
    before a request's ``min_tokens``."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config, eos_token_ids)
    from minivllm.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, eos_token_ids)


class UniProcExecutor:
    """The real thing, in this process: the model on one device (CPU or one GPU)."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.device, dtype = config.torch_device, config.torch_dtype
        backend_cls = checked_backend(config)
        model_path = resolve_model_path(config.model)
        self.model, _ = load_model(
            model_path, backend_cls(), dtype, self.device, quantization=config.quantization
        )
        model_config = self.model.config

        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_bytes(
            model_config, config.block_size, dtype, config.kv_cache_memory_bytes
        )
        self.max_model_len = resolve_max_model_len(config, model_config, self.num_kv_blocks)
        self.model_runner = ModelRunner(
            self.model, self.num_kv_blocks, config.block_size, dtype, self.device,
            eos_token_ids,
        )  # fmt: skip

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass  # nothing outside this process to release


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


def num_blocks_for_bytes(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    num_bytes: int,
    tensor_parallel_size: int = 1,
) -> int:
    """How many KV blocks ``num_bytes`` of memory hold: a block stores a key and a value
    vector per layer, KV head and token slot (`arithmetic.kv_bytes_per_token`); split
    across tensor-parallel ranks, only the rank's own KV heads."""
    element_size = torch.empty((), dtype=dtype).element_size()
    bytes_per_block = block_size * arithmetic.kv_bytes_per_token(
        model_config, element_size, tensor_parallel_size
    )
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
