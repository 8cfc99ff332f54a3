"""The executor: everything that runs the model, behind one method (vLLM's ``Executor``).

The engine hands it a `SchedulerOutput` and gets back the sampled tokens, or with
``non_block=True`` a Future of them, computed on a step thread while the engine schedules
the next step (async scheduling). Behind that seam sit model loading, the attention
backend, the KV cache's size and the `ModelRunner`, in this process (`UniProcExecutor`)
or split across worker processes (multiproc_executor.py). An executor only executes: a
fake one stands in in the tests, a cost-model one in the simulator.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from minivllm.config import EngineConfig, checked_backend, resolve_max_model_len
from minivllm.model_runner import ModelRunner
from minivllm.models.arithmetic import num_blocks_for_bytes
from minivllm.models.loader import load_model
from minivllm.models.model_files import resolve_model_path
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.utils import resolve_obj_by_qualname


class Executor(Protocol):
    num_kv_blocks: int  # blocks in the KV cache
    max_model_len: int  # longest request (prompt + output) it accepts
    device: torch.device  # where per-request sampling generators live

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step: compute every scheduled chunk, sample where asked. With
        ``non_block``, return at once a Future of that (only async scheduling asks)."""

    def shutdown(self) -> None:
        """Release what it holds (threads, worker processes); later steps are refused."""


def make_executor(config: EngineConfig, eos_token_ids: frozenset[int]) -> Executor:
    """The model in this process, or split across ``tensor_parallel_size`` worker
    processes (vLLM's ``Executor.get_class``, by qualified name: the core imports no
    multi-process machinery). ``eos_token_ids``: what the sampler masks before a
    request's ``min_tokens``."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config, eos_token_ids)
    executor_cls = resolve_obj_by_qualname("minivllm.multiproc_executor.MultiprocExecutor")
    return executor_cls(config, eos_token_ids)


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
        self.step_thread: ThreadPoolExecutor | None = None  # made by the first non_block

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.model_runner.execute_model(scheduler_output)
        if self.step_thread is None:  # one thread: steps run in the order they come
            self.step_thread = ThreadPoolExecutor(1, thread_name_prefix="minivllm-step")
        return self.step_thread.submit(self.model_runner.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self.step_thread is not None:
            self.step_thread.shutdown()
