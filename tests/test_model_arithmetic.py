"""The model's arithmetic (minivllm/models/arithmetic.py): exact counts for known shapes,
the real model's ``numel()``, and the tensor-parallel split."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.models import arithmetic as ar
from minivllm.models.config import ModelConfig
from minivllm.models.llama import CausalLM
from minivllm.simulator.models import MODELS

LLAMA_8B = MODELS["llama-3.1-8b"]


def tiny_config(**changes) -> ModelConfig:
    shape = dict(
        vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, max_position_embeddings=64,
        inv_freq=torch.ones(1),
    )  # fmt: skip
    return ModelConfig(**(shape | changes))


def numel(config: ModelConfig) -> int:
    """Parameters of the real model built from ``config`` (tied weights counted once)."""
    with torch.device("meta"):
        model = CausalLM(config, TorchAttentionBackend())
    return sum(p.numel() for p in model.parameters())


# --- exact counts for published shapes -----------------------------------------------


def test_llama_3_1_8b_parameters():
    # q, k, v: 4096 x (4096 + 2 x 1024); o: 4096 x 4096; MLP: 3 x 4096 x 14336
    assert ar.layer_matmul_parameters(LLAMA_8B) == 25_165_824 + 16_777_216 + 176_160_768
    assert ar.layer_parameters(LLAMA_8B) == 218_103_808 + 2 * 4096
    assert ar.vocab_parameters(LLAMA_8B) == 128_256 * 4096
    # embedding + LM head + 32 layers + final norm: the published 8.03 B
    assert ar.num_parameters(LLAMA_8B) == 8_030_261_248


@pytest.mark.parametrize(
    "name, parameters",
    [
        ("smollm2-135m", 134_515_008),  # tied embeddings
        ("qwen3-8b", 8_190_735_360),  # q/k norms
        ("llama-3.1-70b", 70_553_706_496),
    ],
)
def test_preset_parameters_match_the_published_counts(name, parameters):
    assert ar.num_parameters(MODELS[name]) == parameters


def test_llama_3_1_8b_flops_per_token():
    matmuls = 2 * (32 * 218_103_808 + 525_336_576)  # 15.0 GFLOP, the LM head included
    assert ar.decode_flops(LLAMA_8B, 1) == matmuls + 4 * 4096 * 1 * 32
    # attention at a context of 1,024: 0.54 GFLOP
    assert ar.decode_flops(LLAMA_8B, 1024) == matmuls + 536_870_912 == 15_546_187_776
    # a 3-token prompt: 3 rows, 1 + 2 + 3 keys, one sampled row
    assert ar.prefill_flops(LLAMA_8B, 3) == (
        2 * 3 * 32 * 218_103_808 + 4 * 4096 * 6 * 32 + 2 * 4096 * 128_256
    )


def test_kv_bytes_per_token():
    assert ar.kv_bytes_per_token(LLAMA_8B, 2) == 128 * 1024
    assert ar.kv_bytes_per_token(MODELS["llama-3.1-70b"], 2) == 320 * 1024
    assert ar.kv_bytes_per_token(MODELS["qwen3-8b"], 2) == 144 * 1024
    assert ar.kv_bytes_per_token(MODELS["smollm2-135m"], 2) == 22.5 * 1024
    assert ar.kv_bytes_per_token(MODELS["smollm2-135m"], 4) == 45 * 1024  # fp32


# --- the tensor-parallel split ------------------------------------------------------


def test_llama_3_1_8b_on_eight_devices():
    # per device: 4 query heads, 1 KV head, 1,792 MLP columns, 16,032 vocabulary rows
    assert ar.layer_matmul_parameters(LLAMA_8B, tp=8) == (
        4096 * (512 + 2 * 128) + 512 * 4096 + 3 * 4096 * 1792
    )
    assert ar.layer_parameters(LLAMA_8B, tp=8) == 27_262_976 + 2 * 4096  # norms replicated
    assert ar.vocab_parameters(LLAMA_8B, tp=8) == 16_032 * 4096
    assert ar.num_parameters(LLAMA_8B, tp=8) == 2 * 65_667_072 + 32 * 27_271_168 + 4096
    assert ar.kv_bytes_per_token(LLAMA_8B, 2, tp=8) == 16 * 1024
    assert ar.decode_flops(LLAMA_8B, 1024, tp=8) == (
        2 * 32 * 27_262_976 + 4 * 512 * 1024 * 32 + 2 * 4096 * 16_032
    )
    assert ar.prefill_flops(LLAMA_8B, 3, tp=8) == (
        2 * 3 * 32 * 27_262_976 + 4 * 512 * 6 * 32 + 2 * 4096 * 16_032
    )


def test_more_devices_than_kv_heads_replicate_them():
    """16 devices for 8 KV heads: each holds one KV head, as with 8 devices."""
    assert ar.kv_heads_per_rank(8, 16) == 1
    assert ar.kv_bytes_per_token(LLAMA_8B, 2, tp=16) == ar.kv_bytes_per_token(LLAMA_8B, 2, tp=8)
    # 2 query heads (256 wide), 1 KV head (128) still: k and v are not split further
    assert ar.layer_matmul_parameters(LLAMA_8B, tp=16) == (
        4096 * (256 + 2 * 128) + 256 * 4096 + 3 * 4096 * 896
    )


@pytest.mark.parametrize(
    "num_kv_heads, tp, expected", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (3, 3, 1)]
)
def test_kv_heads_per_rank(num_kv_heads, tp, expected):
    assert ar.kv_heads_per_rank(num_kv_heads, tp) == expected


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_valid_splits_are_accepted(tp):
    ar.check_tensor_parallel(32, 8, tp)


@pytest.mark.parametrize(
    "heads, kv_heads, tp, message",
    [
        (32, 8, 3, "the model's 32 attention heads must be divisible by tensor_parallel_size=3"),
        (32, 8, 64, "32 attention heads must be divisible by tensor_parallel_size=64"),
        (24, 8, 12, "the model's 8 KV heads must be divisible by tensor_parallel_size=12, or"),
        (32, 8, 0, "tensor_parallel_size must be an integer >= 1, got 0"),
        (32, 8, True, "tensor_parallel_size must be an integer >= 1, got True"),
        (32, 8, 2.0, "tensor_parallel_size must be an integer >= 1, got 2.0"),
    ],
)
def test_invalid_splits_are_refused_naming_the_counts(heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=message):
        ar.check_tensor_parallel(heads, kv_heads, tp)


def test_even_splits_divide_the_work_exactly():
    """With heads, KV heads, MLP and vocabulary divisible by tp, the devices together
    compute exactly the model's FLOPs."""
    for tp in (1, 2, 4, 8):
        assert ar.linear_flops(LLAMA_8B, 5, tp) * tp == ar.linear_flops(LLAMA_8B, 5)
        assert ar.attention_flops(LLAMA_8B, 77, tp) * tp == ar.attention_flops(LLAMA_8B, 77)
        assert ar.lm_head_flops(LLAMA_8B, 3, tp) * tp == ar.lm_head_flops(LLAMA_8B, 3)


# --- FLOPs of a chunk and of a request -----------------------------------------------


def test_keys_attended_is_causal():
    assert ar.keys_attended(1) == 1
    assert ar.keys_attended(3) == 1 + 2 + 3
    assert ar.keys_attended(3, start_position=2) == 3 + 4 + 5
    assert ar.keys_attended(1, start_position=9) == 10


def test_tiny_flops_by_hand():
    tiny = tiny_config()
    # one layer's matrices: q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4x8 = 96
    assert ar.layer_matmul_parameters(tiny) == 144
    assert ar.linear_flops(tiny, 3) == 2 * 3 * 2 * 144
    assert ar.attention_flops(tiny, 12) == 4 * 4 * 12 * 2
    assert ar.lm_head_flops(tiny, 1) == 2 * 4 * 10
    assert ar.forward_flops(tiny, 3, 12, 1) == 1728 + 384 + 80


@given(st.integers(1, 50), st.integers(0, 50))
def test_a_request_is_its_prefill_and_its_decodes(num_prompt, num_output):
    """``request_flops`` = the prompt in one pass + one decode per later token (the last
    output token is never fed back); without output, the prompt's rows only."""
    tiny = tiny_config()
    total = ar.request_flops(tiny, num_prompt, num_output)
    if num_output == 0:
        rows = num_prompt - 1
        assert total == ar.forward_flops(tiny, rows, ar.keys_attended(rows), 0)
        return
    decodes = sum(ar.decode_flops(tiny, num_prompt + i + 1) for i in range(num_output - 1))
    assert total == ar.prefill_flops(tiny, num_prompt) + decodes


# --- parameters equal the real model's numel() -----------------------------------------


@pytest.mark.parametrize(
    "qkv_bias, o_bias, mlp_bias, qk_norm, tie", list(itertools.product([False, True], repeat=5))
)
def test_parameters_equal_the_models_numel_for_every_switch(
    qkv_bias, o_bias, mlp_bias, qk_norm, tie
):
    config = tiny_config(
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm,
        tie_word_embeddings=tie,
    )  # fmt: skip
    assert ar.num_parameters(config) == numel(config)


@given(
    st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.sampled_from([2, 4, 8]),
    st.integers(1, 24), st.integers(1, 20), st.booleans(), st.booleans(),
)  # fmt: skip
def test_parameters_equal_numel_for_random_shapes(
    layers, kv_heads, group, head_dim, intermediate, vocab, qkv_bias, tie
):
    heads = kv_heads * group
    config = tiny_config(
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        hidden_size=heads * head_dim, intermediate_size=intermediate, vocab_size=vocab,
        qkv_bias=qkv_bias, tie_word_embeddings=tie,
    )  # fmt: skip
    assert ar.num_parameters(config) == numel(config)


def test_loaded_tiny_checkpoints_have_that_many_parameters(tiny_model_path):
    """Every tiny test architecture (llama, mistral, qwen2 with q/k/v biases, qwen3 with
    q/k norms; tied and untied), loaded for real."""
    from minivllm.models.loader import load_model

    model, _ = load_model(tiny_model_path, TorchAttentionBackend(), torch.float32, "cpu")
    assert ar.num_parameters(model.config) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_smollm2_has_as_many_parameters_as_its_preset(smollm2_path):
    from minivllm.models.loader import load_model

    model, _ = load_model(smollm2_path, TorchAttentionBackend(), torch.float32, "cpu")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert ar.num_parameters(model.config) == ar.num_parameters(MODELS["smollm2-135m"])


@pytest.mark.parametrize("tp", [1, 2, 8, 16])
def test_counts_are_exact_integers(tp):
    """Never floats, at any split: FLOPs of long contexts exceed 2^53, where a float
    stops counting exactly."""
    counts = [
        ar.kv_heads_per_rank(8, tp), ar.layer_matmul_parameters(LLAMA_8B, tp),
        ar.layer_parameters(LLAMA_8B, tp), ar.num_parameters(LLAMA_8B, tp),
        ar.keys_attended(3, 2), ar.attention_flops(LLAMA_8B, 7, tp),
        ar.decode_flops(LLAMA_8B, 9, tp), ar.prefill_flops(LLAMA_8B, 9, tp),
        ar.request_flops(LLAMA_8B, 5, 2), ar.kv_bytes_per_token(LLAMA_8B, 2, tp),
    ]  # fmt: skip
    assert all(type(count) is int for count in counts)
