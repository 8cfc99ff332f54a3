"""The simulator's cost model and KV pool sizing against hand-computed values."""

import pytest

from minivllm.simulator.cost_model import (
    ChunkShape,
    StepShape,
    allreduce_seconds,
    attention_flops,
    keys_attended,
    kv_bytes_per_token,
    kv_read_bytes,
    kv_write_bytes,
    linear_flops,
    lm_head_flops,
    step_bytes,
    step_cost,
    step_flops,
    weight_bytes,
)
from minivllm.simulator.hardware import Hardware, get_hardware
from minivllm.simulator.memory import activation_bytes, size_kv_pool
from minivllm.simulator.models import MODELS, ModelShape, get_model

# q_size = 2 heads x 2 = 4, kv_size = 1 x 2 = 2.
# One layer's matrices: q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4x8 = 96; total 144.
TINY = ModelShape(
    "tiny", "none", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=2, max_position_embeddings=64,
)  # fmt: skip
TOY_DEVICE = Hardware(
    "toy", peak_flops=1000.0, memory_bandwidth=100.0, memory_bytes=100_000, dtype_bytes=2,
    link_bandwidth=10.0, flops_efficiency=0.5, bandwidth_efficiency=0.5,
    step_overhead_s=0.25, allreduce_latency_s=1.0,
)  # fmt: skip


def test_parameter_counts():
    assert TINY.layer_linear_params == 144
    assert TINY.layer_params == 144 + 2 * 4  # two RMSNorm weights
    # embedding 40 + 2 layers x 152 + final norm 4 + untied LM head 40
    assert TINY.num_parameters == 388


def test_flops_by_hand():
    assert linear_flops(TINY, 3) == 2 * 3 * 2 * 144  # 1728
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)  # positions 2, 3, 4
    assert keys_attended(chunk) == 3 + 4 + 5
    assert attention_flops(TINY, chunk) == 4 * 4 * 12 * 2  # 384
    assert lm_head_flops(TINY, 1) == 2 * 4 * 10  # 80
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


def test_tensor_parallel_splits_work_and_adds_allreduces():
    chunk = ChunkShape(num_tokens=3, context_len=5, sample=True)
    one, two = step_cost(TINY, TOY_DEVICE, [chunk]), step_cost(TINY, TOY_DEVICE, [chunk], tp=2)
    assert two.flops == one.flops // 2
    # Weights halve; with one KV head, each device still holds it: KV bytes stay.
    assert two.bytes == 696 // 2 + 80 + 48
    # 2 all-reduces x 2 layers, each 1 s latency + 2 x (1/2) x (3 rows x 4 x 2 bytes) / 10
    assert allreduce_seconds(TINY, 3, TOY_DEVICE, 2) == pytest.approx(4 * (1 + 24 / 10))
    assert two.communication_s == pytest.approx(4 * 3.4)
    assert one.communication_s == 0


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
    assert round(llama.num_parameters / 1e9, 2) == 8.03
    assert kv_bytes_per_token(llama, 2) == 128 * 1024
    sizing = size_kv_pool(llama, get_hardware("h200"))
    # 0.9 x 141 GiB - 14.96 GiB weights - activations, in 2 MiB blocks
    assert sizing.block_bytes == 2 << 20
    expected = (int(0.9 * 141 * 2**30) - 2 * llama.num_parameters - sizing.activations) // (2 << 20)
    assert sizing.num_blocks == expected
    assert 50_000 < sizing.num_blocks < 60_000


def test_70b_does_not_fit_one_h200_but_fits_two():
    llama70 = get_model("llama-3.1-70b")
    assert size_kv_pool(llama70, get_hardware("h200")).num_blocks == 0
    assert size_kv_pool(llama70, get_hardware("h200"), tp=2).num_blocks > 10_000


def test_bad_presets_list_the_choices():
    with pytest.raises(ValueError, match="h200, h100, a100-80gb, l4, this-cpu"):
        get_hardware("h300")
    with pytest.raises(ValueError, match="smollm2-135m, llama-3.1-8b"):
        get_model("llama-4")


@pytest.mark.slow
def test_smollm2_preset_matches_the_converted_checkpoint(smollm2_path):
    import json

    hf = json.loads((smollm2_path / "config.json").read_text())
    shape = MODELS["smollm2-135m"]
    assert (shape.hidden_size, shape.intermediate_size) == (
        hf["hidden_size"],
        hf["intermediate_size"],
    )
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads) == (
        hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
    )  # fmt: skip
    assert (shape.vocab_size, shape.head_dim) == (hf["vocab_size"], hf["head_dim"])
