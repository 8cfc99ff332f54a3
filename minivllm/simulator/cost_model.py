"""How long one engine step takes on a device: a roofline over the step's chunks.

    time = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)
           + tensor-parallel all-reduces + a fixed per-step overhead

A step computes a list of chunks (`ChunkShape`): ``num_tokens`` query rows of one
request whose context, after the step, is ``context_len`` tokens; a token is sampled
after the chunk's last row when ``sample`` is set (with ``num_verified`` > 1 rows when
speculative decoding verifies drafts). Each term is a small function that can be checked
by hand (tests/test_simulator_cost_model.py does, for a tiny model); the model's own
counts (parameters, FLOPs, KV bytes per token, each on one rank) come from
`minivllm.models.arithmetic`, as for the real engine and the bench.

- FLOPs (2 per multiply-add): the linear layers for every row; attention of each row
  over its context (q.k and p.v); the vocabulary projection for sampled rows only.
- Bytes: every weight once per step (the whole batch shares one read); each request's
  keys and values read once; the new keys and values written.
- Tensor parallelism over ``tp`` devices (checked by `arithmetic.check_tensor_parallel`):
  each device holds its share of the heads, MLP columns and vocabulary, KV heads
  replicated when there are more devices than KV heads; two ring all-reduces of the
  hidden states per layer (after attention and after the MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minivllm.models import arithmetic
from minivllm.models.config import ModelConfig
from minivllm.simulator.hardware import Hardware


@dataclass(frozen=True)
class ChunkShape:
    num_tokens: int  # query rows computed this step
    context_len: int  # tokens in the cache after the step: start position + num_tokens
    sample: bool  # a token is sampled after the last row
    num_verified: int = 1  # rows sampled when it samples: 1 + its draft tokens

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_tokens


def keys_attended(chunk: ChunkShape) -> int:
    """Sum over the chunk's rows of the keys each one attends to (causal)."""
    return arithmetic.keys_attended(chunk.num_tokens, chunk.start_position)


@dataclass(frozen=True)
class StepShape:
    """A step's chunks, summed: all the cost model needs (one pass over the chunks)."""

    num_rows: int
    num_sampled: int  # rows the LM head runs on
    keys_attended: int  # summed over every row of every chunk
    context_tokens: int  # summed over chunks: KV each one reads
    any_sampled: bool

    @classmethod
    def of(cls, chunks: list[ChunkShape]) -> StepShape:
        rows = sampled = keys = context = 0
        for c in chunks:
            rows += c.num_tokens
            sampled += c.num_verified if c.sample else 0
            keys += keys_attended(c)
            context += c.context_len
        return cls(rows, sampled, keys, context, sampled > 0)

    @classmethod
    def of_batch(
        cls, query_lens: np.ndarray, context_lens: np.ndarray, num_sampled: int
    ) -> StepShape:
        """The same sums, from a step's per-chunk arrays (``AttentionMetadata``'s query and
        context lengths) in a few numpy operations instead of one Python object per chunk:
        a static batch's step has a chunk for every member, padding included, so this is
        the simulator's per-step cost that grows with the batch. The counts are exact
        integers, so both ways give the same step."""
        query_lens = query_lens.astype(np.int64)
        context_lens = context_lens.astype(np.int64)
        # `arithmetic.keys_attended`'s formula, elementwise over the chunks.
        keys = arithmetic.keys_attended(query_lens, context_lens - query_lens)
        rows, context = int(query_lens.sum()), int(context_lens.sum())
        return cls(rows, num_sampled, int(keys.sum()), context, num_sampled > 0)


def step_flops(model: ModelConfig, step: StepShape, tp: int = 1) -> int:
    """FLOPs one device computes (`arithmetic.forward_flops`, its share)."""
    return arithmetic.forward_flops(model, step.num_rows, step.keys_attended, step.num_sampled, tp)


# --- bytes ---------------------------------------------------------------------------


def weight_bytes(
    model: ModelConfig,
    dtype_bytes: int,
    with_lm_head: bool = True,
    tp: int = 1,
    quantization: str | None = None,
) -> int:
    """Weights one device reads once per step: every layer, the final norm, and the LM
    head when a token is sampled (the input embedding is a lookup of a few rows: not
    counted; a tied LM head is the embedding, read as the LM head). ``quantization``:
    the matrices' bytes per weight in that format (`arithmetic.bytes_per_weight`)."""
    return arithmetic.weight_bytes(model, dtype_bytes, tp, quantization, with_lm_head)


def kv_read_bytes(model: ModelConfig, chunk: ChunkShape, dtype_bytes: int, tp: int = 1) -> int:
    """Attention reads the chunk's whole context from the cache once."""
    return chunk.context_len * arithmetic.kv_bytes_per_token(model, dtype_bytes, tp)


def kv_write_bytes(model: ModelConfig, chunk: ChunkShape, dtype_bytes: int, tp: int = 1) -> int:
    return chunk.num_tokens * arithmetic.kv_bytes_per_token(model, dtype_bytes, tp)


def step_bytes(
    model: ModelConfig,
    step: StepShape,
    dtype_bytes: int,
    tp: int = 1,
    quantization: str | None = None,
) -> int:
    """Bytes one device moves: its share of the weights plus its heads' KV traffic
    (`kv_read_bytes` and `kv_write_bytes` summed over the chunks)."""
    weights = weight_bytes(model, dtype_bytes, step.any_sampled, tp, quantization)
    kv_tokens = step.context_tokens + step.num_rows
    return weights + kv_tokens * arithmetic.kv_bytes_per_token(model, dtype_bytes, tp)


# --- communication and the step ------------------------------------------------------


def allreduce_seconds(model: ModelConfig, num_rows: int, hardware: Hardware, tp: int) -> float:
    """Two ring all-reduces per layer of the ``[num_rows, hidden_size]`` activations. A
    ring all-reduce is a reduce-scatter then an all-gather, ``tp - 1`` steps each: every
    step pays the link's latency, and each device sends (and receives) 2 (tp - 1) / tp of
    the tensor in all."""
    if tp == 1:
        return 0.0
    tensor_bytes = num_rows * model.hidden_size * hardware.dtype_bytes
    latency = 2 * (tp - 1) * hardware.link_latency_s
    transfer = 2 * (tp - 1) / tp * tensor_bytes / hardware.link_bandwidth
    return 2 * model.num_layers * (latency + transfer)


@dataclass(frozen=True)
class StepCost:
    flops: int  # per device
    bytes: int  # per device
    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.communication_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def step_cost(
    model: ModelConfig,
    hardware: Hardware,
    chunks: list[ChunkShape],
    tp: int = 1,
    quantization: str | None = None,
) -> StepCost:
    """The roofline time of one step that computes ``chunks`` on ``tp`` devices, with the
    weights in ``quantization``'s format (None: ``hardware.dtype_bytes`` each)."""
    return shape_cost(model, hardware, StepShape.of(chunks), tp, quantization)


def shape_cost(
    model: ModelConfig,
    hardware: Hardware,
    step: StepShape,
    tp: int = 1,
    quantization: str | None = None,
) -> StepCost:
    """`step_cost` of a step whose chunks are already summed."""
    flops = step_flops(model, step, tp)
    num_bytes = step_bytes(model, step, hardware.dtype_bytes, tp, quantization)
    num_rows = step.num_rows
    return StepCost(
        flops=flops,
        bytes=num_bytes,
        compute_s=flops / hardware.achievable_flops,
        memory_s=num_bytes / hardware.achievable_bandwidth,
        communication_s=allreduce_seconds(model, num_rows, hardware, tp),
        overhead_s=hardware.step_overhead_s,
    )
