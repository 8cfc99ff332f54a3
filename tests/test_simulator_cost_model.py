"""The simulator's cost model and KV pool sizing against hand-computed values."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.models import arithmetic
from minivllm.models.arithmetic import kv_bytes_per_token
from minivllm.simulator.cost_model import (
    ChunkShape,
    StepShape,
    allreduce_seconds,
    keys_attended,
    kv_read_bytes,
    kv_write_bytes,
    shape_cost,
    step_bytes,
    step_cost,
    step_flops,
    weight_bytes,
)
from minivllm.simulator.hardware import Hardware, get_hardware
from minivllm.simulator.memory import activation_bytes, size_kv_pool
from minivllm.simulator.models import MODELS, get_model, preset_name, shape_json
from tests.test_model_arithmetic import tiny_config

# q_size = 2 heads x 2 = 4, kv_size = 1 x 2 = 2.
# One layer's matrices: q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4x8 = 96; total 144.
TINY = tiny_config()
TOY_DEVICE = Hardware(
    "toy", peak_flops=1000.0, memory_bandwidth=100.0, memory_bytes=100_000, dtype_bytes=2,
    link_bandwidth=10.0, flops_efficiency=0.5, bandwidth_efficiency=0.5,
    step_overhead_s=0.25, link_latency_s=1.0,
)  # fmt: skip


def test_parameter_counts():
    assert arithmetic.layer_matmul_parameters(TINY) == 144
    assert arithmetic.layer_parameters(TINY) == 144 + 2 * 4  # two RMSNorm weights
    # embedding 40 + 2 layers x 152 + final norm 4 + untied LM head 40
    assert arithmetic.num_parameters(TINY) == 388


def test_flops_by_hand():
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)  # positions 2, 3, 4
    assert keys_attended(chunk) == 3 + 4 + 5
    # linear 2 x 3 rows x 2 layers x 144 = 1728; attention 4 x 4 x 12 x 2 = 384; LM head 80
    assert step_flops(TINY, StepShape.of([chunk])) == 1728 + 384 + 80
    padding = ChunkShape(num_tokens=1, context_len=1, sample=False)  # 1 key, no LM head
    assert (
        step_flops(TINY, StepShape.of([chunk, padding]))
        == 2 * 4 * 2 * 144 + 384 + 4 * 4 * 1 * 2 + 80
    )


def test_bytes_by_hand():
    # 2 layers x 152 + final norm 4 = 308 params; + LM head 40 = 348; x 2 bytes
    assert weight_bytes(TINY, 2) == 696
    assert weight_bytes(TINY, 2, with_lm_head=False) == 616
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)
    # one token's K and V: 2 x 2 layers x 1 head x 2 dims x 2 bytes = 16
    assert kv_read_bytes(TINY, chunk, 2) == 5 * 16
    assert kv_write_bytes(TINY, chunk, 2) == 3 * 16
    assert step_bytes(TINY, StepShape.of([chunk]), 2) == 696 + 80 + 48
    no_sample = ChunkShape(num_tokens=3, context_len=5, sample=False)
    assert step_bytes(TINY, StepShape.of([no_sample]), 2) == 616 + 80 + 48


def test_step_time_is_the_roofline_plus_overhead():
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)
    cost = step_cost(TINY, TOY_DEVICE, [chunk])
    flops = 1728 + 384 + 80
    assert cost.flops == flops
    assert cost.compute_s == pytest.approx(flops / 500)  # 4.384 s
    assert cost.memory_s == pytest.approx(824 / 50)  # 16.48 s: memory-bound
    assert cost.bound == "memory"
    assert cost.seconds == pytest.approx(824 / 50 + 0.25)


def test_drafts_verified_run_the_lm_head_on_every_verified_row():
    """A decode with 3 drafts computes 4 rows and samples from all 4."""
    verify = ChunkShape(num_tokens=4, context_len=10, sample=True, num_verified=4)
    step = StepShape.of([verify])
    assert step.num_sampled == 4
    assert step_flops(TINY, step) == 2 * 4 * 2 * 144 + 4 * 4 * (7 + 8 + 9 + 10) * 2 + 4 * 80


def test_tensor_parallel_splits_work_and_adds_allreduces():
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)
    one, two = step_cost(TINY, TOY_DEVICE, [chunk]), step_cost(TINY, TOY_DEVICE, [chunk], tp=2)
    # Per device: 1 query head, the one KV head replicated, half the MLP and vocabulary:
    # a layer's matrices 4 x (2 + 4) + 2 x 4 + 3 x 4 x 4 = 80 (not 144 / 2: k and v whole)
    assert two.flops == 2 * 3 * 2 * 80 + 4 * 2 * 12 * 2 + 2 * 4 * 5
    # weights: 2 layers x (80 + 8 norms) + final norm 4 + 5 vocabulary rows x 4, x 2 bytes;
    # the replicated KV head's bytes stay whole
    assert two.bytes == (2 * 88 + 4 + 20) * 2 + 80 + 48
    # 2 all-reduces x 2 layers, each 2 ring steps x 1 s + 2 x (1/2) x (3 x 4 x 2 bytes) / 10
    assert allreduce_seconds(TINY, 3, TOY_DEVICE, 2) == pytest.approx(4 * (2 + 24 / 10))
    assert two.communication_s == pytest.approx(4 * 4.4)
    assert one.communication_s == 0


def test_the_ring_allreduce_grows_with_the_devices():
    """2 (tp - 1) latencies and 2 (tp - 1) / tp of the tensor per device: 8 devices pay
    14 latencies, not one."""
    for tp in (2, 4, 8):
        ring = 2 * (tp - 1) * 1.0 + 2 * (tp - 1) / tp * 24 / 10
        assert allreduce_seconds(TINY, 3, TOY_DEVICE, tp) == pytest.approx(4 * ring)
    eight = allreduce_seconds(TINY, 3, TOY_DEVICE, 8)
    assert eight > 3 * allreduce_seconds(TINY, 3, TOY_DEVICE, 2)


def test_kv_pool_sizing_by_hand():
    sizing = size_kv_pool(
        TINY, TOY_DEVICE, gpu_memory_utilization=0.5, block_size=4,
        max_num_batched_tokens=4, max_num_seqs=2,
    )  # fmt: skip
    assert sizing.budget == 50_000
    assert sizing.weights == 388 * 2
    # per token: residual + normed 8, q/k/v 8, attention out 4, gate/up/product 24 = 44
    # x 4 tokens x 2 bytes = 352; fp32 logits for 2 rows: 2 x 10 x 4 = 80
    assert activation_bytes(TINY, 4, 2, 2, 1) == 352 + 80
    assert sizing.activations == 432
    assert sizing.block_bytes == 4 * 16
    assert sizing.num_blocks == (50_000 - 776 - 432) // 64 == 762


def test_llama_8b_on_h200_matches_the_published_shapes():
    llama = get_model("llama-3.1-8b")
    assert arithmetic.num_parameters(llama) == 8_030_261_248
    assert kv_bytes_per_token(llama, 2) == 128 * 1024
    sizing = size_kv_pool(llama, get_hardware("h200"))
    # 0.9 x 141 GiB - 14.96 GiB weights - activations, in 2 MiB blocks
    assert sizing.block_bytes == 2 << 20
    weights = 2 * 8_030_261_248
    expected = (int(0.9 * 141 * 2**30) - weights - sizing.activations) // (2 << 20)
    assert sizing.num_blocks == expected
    assert 50_000 < sizing.num_blocks < 60_000


def test_70b_does_not_fit_one_h200_but_fits_two():
    llama70 = get_model("llama-3.1-70b")
    assert size_kv_pool(llama70, get_hardware("h200")).num_blocks == 0
    assert size_kv_pool(llama70, get_hardware("h200"), tp=2).num_blocks > 10_000


def test_kv_pool_per_device_follows_the_kv_heads_each_one_holds():
    """8 KV heads: 2 devices hold 4 each (a block is a quarter of one device's), 16
    devices hold 1 each, like 8 (a block as on 8 devices, replicated)."""
    llama, h200 = get_model("llama-3.1-8b"), get_hardware("h200")
    block = {tp: size_kv_pool(llama, h200, tp=tp).block_bytes for tp in (1, 2, 8, 16)}
    assert block == {1: 2 << 20, 2: 1 << 20, 8: 256 << 10, 16: 256 << 10}


def test_presets_are_model_configs_with_names():
    assert preset_name(get_model("qwen3-8b")) == "qwen3-8b"
    assert preset_name(TINY) == "custom"
    shape = shape_json(get_model("llama-3.1-8b"))
    assert shape["name"] == "llama-3.1-8b" and shape["num_kv_heads"] == 8
    assert "inv_freq" not in shape


def test_bad_presets_list_the_choices():
    with pytest.raises(ValueError, match="h200, h100, a100-80gb, l4, this-cpu"):
        get_hardware("h300")
    with pytest.raises(ValueError, match="smollm2-135m, llama-3.1-8b"):
        get_model("llama-4")


@pytest.mark.slow
def test_smollm2_preset_matches_the_converted_checkpoint(smollm2_path):
    import json

    hf = json.loads((smollm2_path / "config.json").read_text())
    shape = MODELS["smollm2-135m"]  # a ModelConfig
    assert (shape.hidden_size, shape.intermediate_size) == (
        hf["hidden_size"],
        hf["intermediate_size"],
    )
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads) == (
        hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
    )  # fmt: skip
    assert (shape.vocab_size, shape.head_dim) == (hf["vocab_size"], hf["head_dim"])


chunk_shapes = st.builds(
    lambda n, start, sample, drafts: ChunkShape(n, start + n, sample, 1 + drafts),
    n=st.integers(1, 600),
    start=st.integers(0, 5000),
    sample=st.booleans(),
    drafts=st.integers(0, 4),
)


@given(st.lists(chunk_shapes, min_size=1, max_size=40))
def test_a_step_summed_from_arrays_equals_the_step_summed_chunk_by_chunk(chunks):
    """The executor sums a step from its attention metadata's arrays (`StepShape.of_batch`):
    the same integers as the chunk-by-chunk sum, so the same step time."""
    query_lens = np.array([c.num_tokens for c in chunks], dtype=np.int32)
    context_lens = np.array([c.context_len for c in chunks], dtype=np.int32)
    num_sampled = sum(c.num_verified for c in chunks if c.sample)
    assert StepShape.of_batch(query_lens, context_lens, num_sampled) == StepShape.of(chunks)
    for tp in (1, 2):
        from_arrays = shape_cost(
            TINY, TOY_DEVICE, StepShape.of_batch(query_lens, context_lens, num_sampled), tp
        )
        assert from_arrays == step_cost(TINY, TOY_DEVICE, chunks, tp)
