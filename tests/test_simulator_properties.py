"""Properties of ``minivllm simulate`` over random deployments: it never beats physics,
and it refuses what the real engine refuses, with the engine's words."""

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from minivllm.config import EngineConfig
from minivllm.models import arithmetic
from minivllm.simulator.acceptance import MEASURED, AcceptanceProfile
from minivllm.simulator.cluster import Deployment, simulate
from minivllm.simulator.hardware import HARDWARE
from minivllm.simulator.models import MODELS
from minivllm.simulator.workloads import chat_workload


def valid_splits(name: str) -> list[int]:
    model = MODELS[name]
    return [tp for tp in range(1, 65) if _accepted(model, tp)]


def _accepted(model, tp: int) -> bool:
    try:
        arithmetic.check_tensor_parallel(model.num_heads, model.num_kv_heads, tp)
    except ValueError:
        return False
    return True


@st.composite
def deployments(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    tp = draw(st.sampled_from(valid_splits(name)))
    hardware = HARDWARE[draw(st.sampled_from(sorted(HARDWARE)))]
    return Deployment(MODELS[name], hardware, tp)


@given(
    deployment=deployments(),
    max_num_seqs=st.integers(1, 64),
    num_requests=st.integers(1, 24),
    request_rate=st.sampled_from([math.inf, 5.0, 100.0]),
    num_speculative_tokens=st.sampled_from([0, 1, 3]),
    acceptance=st.sampled_from([*MEASURED, "1", "0.5"]),
    seed=st.integers(0, 1000),
)
def test_simulated_throughput_never_beats_the_rooflines(
    deployment, max_num_seqs, num_requests, request_rate, num_speculative_tokens, acceptance, seed
):
    """Every step that emits tokens reads each device's weights once, so at most
    ``batch x (1 + k)`` tokens per weight read (the bandwidth ceiling); and every
    token needs one row through every matrix, split over ``tp`` devices at most (the
    compute ceiling). ``k`` drafts: a verified row can emit up to ``1 + k`` tokens."""
    model, hardware, tp = deployment.model, deployment.hardware, deployment.tensor_parallel_size
    spec = {"num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else None
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=2048, speculative_config=spec)
    deployment.acceptance_profile = AcceptanceProfile.parse(acceptance)
    workload = chat_workload(num_requests, "alpaca", request_rate, seed)
    try:
        run = simulate(config, deployment, workload, record_steps=False)
    except ValueError as e:  # e.g. 70B on one L4: refused before any work
        assert "does not fit" in str(e)
        assume(False)
    tokens_per_s = run.summary.output_throughput
    batch = min(max_num_seqs, num_requests)

    weights = arithmetic.num_parameters(model, tp) - arithmetic.vocab_parameters(model, tp)
    weight_read_s = weights * hardware.dtype_bytes / hardware.achievable_bandwidth
    assert tokens_per_s <= batch * (1 + num_speculative_tokens) / weight_read_s
    assert tokens_per_s <= batch * (1 + num_speculative_tokens) / (
        weights * hardware.dtype_bytes / hardware.memory_bandwidth
    )  # the spec sheet's bandwidth, a looser ceiling still
    flops_per_token = arithmetic.decode_flops(model, 1)  # the fewest: attention over 1 key
    assert tokens_per_s <= tp * hardware.achievable_flops / flops_per_token


@given(name=st.sampled_from(sorted(MODELS)), tp=st.integers(-2, 1024))
def test_invalid_splits_are_refused_with_the_engines_message(name, tp):
    model = MODELS[name]
    assume(not _accepted(model, tp))
    with pytest.raises(ValueError) as engine:
        arithmetic.check_tensor_parallel(model.num_heads, model.num_kv_heads, tp)
    with pytest.raises(ValueError) as simulator:
        Deployment(model, HARDWARE["h200"], tp)
    assert str(simulator.value) == str(engine.value)
