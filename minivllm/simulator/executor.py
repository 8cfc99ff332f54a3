"""`SimulatedExecutor`: the engine's executor seam, with a cost model instead of a model.

The engine, its scheduler (continuous or static), the KV-cache manager and the prefix
cache run unchanged; they cannot tell the difference. Each `execute_model` call builds
the real model runner's inputs for the scheduled chunks, asks the cost model how long
that step would take on the simulated hardware (from the sums of the chunks' shapes),
moves the simulated clock forward by that much, and "samples" a placeholder token for
every chunk that samples. Requests end at their ``max_tokens`` (the workload's output
length, with ``ignore_eos``).

With speculative decoding, a decode chunk carries draft tokens; the executor costs
their rows and keeps as many as the `AcceptanceProfile` draws (acceptance.py), so the
scheduler's own bookkeeping (rollback of the rejected ones, the acceptance counters)
runs as with a real model.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from minivllm.config import EngineConfig, resolve_max_model_len
from minivllm.input_batch import InputBatch
from minivllm.models.arithmetic import check_tensor_parallel
from minivllm.models.config import ModelConfig
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.simulator import acceptance
from minivllm.simulator.acceptance import AcceptanceProfile
from minivllm.simulator.clock import SimClock
from minivllm.simulator.cost_model import StepCost, StepShape, shape_cost
from minivllm.simulator.hardware import Hardware
from minivllm.simulator.memory import KVPoolSizing, size_kv_pool
from minivllm.simulator.models import preset_name

PLACEHOLDER_TOKEN = 0


class SimulatedExecutor:
    """Sizes the KV pool like vLLM would on ``hardware`` and times every step."""

    def __init__(
        self,
        model: ModelConfig,
        hardware: Hardware,
        config: EngineConfig,
        clock: SimClock,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        acceptance_profile: AcceptanceProfile | None = None,
        seed: int = 0,
    ) -> None:
        """``acceptance_profile``: how many drafts verify, with speculative decoding
        (default: the measured ``no-copy`` preset); ``seed`` seeds its draws."""
        check_tensor_parallel(model.num_heads, model.num_kv_heads, tensor_parallel_size)
        self.model = model
        self.hardware = hardware
        self.clock = clock
        self.tensor_parallel_size = tensor_parallel_size
        self.quantization = config.quantization  # bytes per weight (arithmetic.weight_bytes)
        self.model_config = model
        self.acceptance = acceptance_profile or AcceptanceProfile.parse(acceptance.DEFAULT)
        self.rng = random.Random(seed)
        self.device = torch.device("cpu")  # where per-request generators would live
        self.kv_pool: KVPoolSizing = size_kv_pool(
            model,
            hardware,
            gpu_memory_utilization,
            config.block_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            tensor_parallel_size,
            config.quantization,
        )
        self.num_kv_blocks = config.num_kv_blocks or self.kv_pool.num_blocks
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"{preset_name(model)} does not fit on {tensor_parallel_size} x {hardware.name} at "
                f"gpu_memory_utilization={gpu_memory_utilization}: weights "
                f"{self.kv_pool.weights / 2**30:.1f} GiB + activations "
                f"{self.kv_pool.activations / 2**30:.1f} GiB per device leave no room for KV "
                "blocks; try a larger --tensor-parallel-size"
            )
        self.max_model_len = resolve_max_model_len(config, self.model_config, self.num_kv_blocks)
        self.step_costs: list[StepCost] | None = None  # set to [] to record every step
        # The real model runner's input preparation runs every step (its tensors go
        # nowhere), so a simulation costs the CPU what the engine's loop really costs.
        self.input_batch = InputBatch(config.block_size, self.device)

    def shutdown(self) -> None:
        pass  # nothing to release

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        _, _, metadata = self.input_batch.prepare(scheduler_output)
        # Requests' own chunks only (``chunk_of``): padding rows sample nothing.
        sampling = [c for c in scheduler_output.chunk_of.values() if c.sample]
        # The cost model sums the chunks from the attention metadata the step just built,
        # with numpy: no Python object per chunk (a static batch pads every member).
        query_lens = np.diff(metadata.cu_seqlens_q.numpy())
        num_sampled = sum(1 + c.num_draft_tokens for c in sampling)  # verified rows too
        step = StepShape.of_batch(query_lens, metadata.context_lens.numpy(), num_sampled)
        cost = shape_cost(
            self.model, self.hardware, step, self.tensor_parallel_size, self.quantization
        )
        self.clock.advance(cost.seconds)
        if self.step_costs is not None:
            self.step_costs.append(cost)
        sampled = {
            c.request_id: [PLACEHOLDER_TOKEN] * (1 + self._num_accepted(c.num_draft_tokens))
            for c in sampling
        }
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _num_accepted(self, num_drafts: int) -> int:
        """The drafts the model would have kept (the accepted ones and one more token are
        returned: the rejection sampler's bonus or correction)."""
        return self.acceptance.num_accepted(num_drafts, self.rng) if num_drafts else 0
