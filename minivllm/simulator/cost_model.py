"""How long one engine step takes on a device: a roofline over the step's chunks.

    time = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)
           + tensor-parallel all-reduces + a fixed per-step overhead

A step computes a list of chunks (`ChunkShape`): ``num_tokens`` query rows of one
request whose context, after the step, is ``context_len`` tokens; a token is sampled
after the chunk's last row when ``sample`` is set. Each term below is a small function
that can be checked by hand (tests/test_simulator_cost_model.py does, for a tiny model).

- FLOPs (2 per multiply-add): the linear layers for every row; attention of each row
  over its context (q.k and p.v); the vocabulary projection for sampled rows only.
- Bytes: every weight once per step (the whole batch shares one read); each request's
  keys and values read once; the new keys and values written.
- Tensor parallelism over ``tp`` devices: weights, heads and FLOPs split ``tp`` ways;
  two all-reduces of the hidden states per layer (after attention and after the MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.simulator.hardware import Hardware
from minivllm.simulator.models import ModelShape


@dataclass(frozen=True)
class ChunkShape:
    num_tokens: int  # query rows computed this step
    context_len: int  # tokens in the cache after the step: start position + num_tokens
    sample: bool  # a token is sampled after the last row

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_tokens


# --- FLOPs ---------------------------------------------------------------------------


def linear_flops(model: ModelShape, num_rows: int) -> int:
    """q, k, v, o and the MLP's three matrices, for ``num_rows`` rows, all layers."""
    return 2 * num_rows * model.num_layers * model.layer_linear_params


def keys_attended(chunk: ChunkShape) -> int:
    """Sum over the chunk's rows of the keys each one attends to: the row at position
    ``p`` sees ``p + 1`` keys (causal)."""
    n, start = chunk.num_tokens, chunk.start_position
    return n * start + n * (n + 1) // 2


def attention_flops(model: ModelShape, chunk: ChunkShape) -> int:
    """q.k and p.v: 2 FLOPs each per query head, head dimension and key, all layers."""
    return 4 * model.q_size * keys_attended(chunk) * model.num_layers


def lm_head_flops(model: ModelShape, num_sampled: int) -> int:
    """The vocabulary projection, only for the rows a token is sampled from."""
    return 2 * model.hidden_size * model.vocab_size * num_sampled


@dataclass(frozen=True)
class StepShape:
    """A step's chunks, summed: all the cost model needs (one pass over the chunks)."""

    num_rows: int
    num_sampled: int
    keys_attended: int  # summed over every row of every chunk
    context_tokens: int  # summed over chunks: KV each one reads
    any_sampled: bool

    @classmethod
    def of(cls, chunks: list[ChunkShape]) -> StepShape:
        rows = sampled = keys = context = 0
        for c in chunks:
            rows += c.num_tokens
            sampled += c.sample
            keys += keys_attended(c)
            context += c.context_len
        return cls(rows, sampled, keys, context, sampled > 0)


def step_flops(model: ModelShape, step: StepShape) -> int:
    attention = 4 * model.q_size * step.keys_attended * model.num_layers  # = attention_flops
    return linear_flops(model, step.num_rows) + attention + lm_head_flops(model, step.num_sampled)


# --- bytes ---------------------------------------------------------------------------


def weight_bytes(model: ModelShape, dtype_bytes: int, with_lm_head: bool = True) -> int:
    """Weights read once per step: every layer, the final norm, and the LM head when a
    token is sampled (the input embedding is a lookup of a few rows: not counted)."""
    params = model.num_layers * model.layer_params + model.hidden_size
    if with_lm_head:
        params += model.embedding_params
    return params * dtype_bytes


def kv_heads_per_device(model: ModelShape, tp: int) -> int:
    """KV heads split over the devices; with fewer heads than devices, each holds one."""
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelShape, dtype_bytes: int, tp: int = 1) -> int:
    """One token's keys and values, all layers, on one device."""
    return 2 * model.num_layers * kv_heads_per_device(model, tp) * model.head_dim * dtype_bytes


def kv_read_bytes(model: ModelShape, chunk: ChunkShape, dtype_bytes: int, tp: int = 1) -> int:
    """Attention reads the chunk's whole context from the cache once."""
    return chunk.context_len * kv_bytes_per_token(model, dtype_bytes, tp)


def kv_write_bytes(model: ModelShape, chunk: ChunkShape, dtype_bytes: int, tp: int = 1) -> int:
    return chunk.num_tokens * kv_bytes_per_token(model, dtype_bytes, tp)


def step_bytes(model: ModelShape, step: StepShape, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes one device moves: its share of the weights plus its heads' KV traffic
    (`kv_read_bytes` and `kv_write_bytes` summed over the chunks)."""
    weights = weight_bytes(model, dtype_bytes, with_lm_head=step.any_sampled) // tp
    kv_tokens = step.context_tokens + step.num_rows
    return weights + kv_tokens * kv_bytes_per_token(model, dtype_bytes, tp)


# --- communication and the step ------------------------------------------------------


def allreduce_seconds(model: ModelShape, num_rows: int, hardware: Hardware, tp: int) -> float:
    """Two ring all-reduces per layer of the ``[num_rows, hidden_size]`` activations: each
    device sends and receives 2 (tp - 1) / tp of the tensor, plus a fixed latency."""
    if tp == 1:
        return 0.0
    tensor_bytes = num_rows * model.hidden_size * hardware.dtype_bytes
    one = hardware.allreduce_latency_s + 2 * (tp - 1) / tp * tensor_bytes / hardware.link_bandwidth
    return 2 * model.num_layers * one


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
    model: ModelShape, hardware: Hardware, chunks: list[ChunkShape], tp: int = 1
) -> StepCost:
    """The roofline time of one step that computes ``chunks`` on ``tp`` devices."""
    step = StepShape.of(chunks)
    flops = step_flops(model, step) // tp
    num_bytes = step_bytes(model, step, hardware.dtype_bytes, tp)
    num_rows = step.num_rows
    return StepCost(
        flops=flops,
        bytes=num_bytes,
        compute_s=flops / hardware.achievable_flops,
        memory_s=num_bytes / hardware.achievable_bandwidth,
        communication_s=allreduce_seconds(model, num_rows, hardware, tp),
        overhead_s=hardware.step_overhead_s,
    )
