"""The simulator: the real schedulers on simulated time, replicas, search, the CLI."""

import time
from dataclasses import replace

import pytest

from minivllm.bench.runner import run_engine
from minivllm.bench.workloads import BenchRequest, LengthDistribution, Workload, synthetic
from minivllm.config import EngineConfig
from minivllm.models.loader import load_hf_config, model_config_from_hf
from minivllm.simulator.cluster import Deployment, search_replicas, simulate
from minivllm.simulator.cost_model import ChunkShape, step_cost
from minivllm.simulator.hardware import get_hardware
from minivllm.simulator.models import get_model, shape_of
from minivllm.simulator.workloads import chat_workload

H200 = get_hardware("h200")
LLAMA_8B = get_model("llama-3.1-8b")


def _composition(step):
    return (step.prefill_ids, step.decode_ids, step.padding_ids, step.num_prefill_tokens)


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_simulated_and_real_engine_make_the_same_decisions(tiny_llama_path, policy):
    """Same scheduler, same workload, same pool: the same requests in every step."""
    workload = synthetic(
        10,
        LengthDistribution.parse("uniform:4:40"),
        LengthDistribution.parse("uniform:4:24"),
        token_range=(3, 256),
        seed=3,
    )
    config = EngineConfig(
        model=str(tiny_llama_path),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=8,  # tight: the continuous policy preempts
        max_model_len=workload.max_request_len,
        scheduling_policy=policy,
        attention_backend="torch",  # no kernel compile: the timing does not matter here
    )
    real = run_engine(config, workload, progress=False)
    shape = shape_of("tiny", model_config_from_hf(load_hf_config(tiny_llama_path)))
    simulated = simulate(replace(config, model=None), Deployment(shape, H200), workload)
    assert [_composition(s) for s in simulated.steps] == [_composition(s) for s in real.steps]
    assert len(real.steps) > 5
    if policy == "continuous":
        assert simulated.summary.num_preemptions == real.summary.num_preemptions > 0


def test_a_lone_request_takes_exactly_its_predicted_steps():
    """Prefill then decodes, each step's time from the cost model, nothing else."""
    request = BenchRequest("0", list(range(3, 103)), max_tokens=3, arrival_time=5.0)
    config = EngineConfig(max_model_len=1024)
    run = simulate(config, Deployment(LLAMA_8B, H200), Workload("one", [request]))
    prefill = step_cost(LLAMA_8B, H200, [ChunkShape(100, 100, True)]).seconds
    decodes = [step_cost(LLAMA_8B, H200, [ChunkShape(1, c, True)]).seconds for c in (101, 102)]
    metrics = run.requests[0].metrics
    assert metrics.arrival_time == 5.0  # the clock jumped to the arrival: no idle steps
    assert metrics.ttft == pytest.approx(prefill)
    assert metrics.e2e_latency == pytest.approx(prefill + sum(decodes))
    assert len(run.steps) == 3


def test_ten_thousand_requests_in_seconds():
    workload = chat_workload(10_000, "alpaca", request_rate=200.0, seed=1)
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    start = time.perf_counter()
    run = simulate(config, Deployment(LLAMA_8B, H200), workload, record_steps=False)
    assert time.perf_counter() - start < 60
    assert len(run.requests) == 10_000
    wanted = {r.request_id: r.max_tokens for r in workload.requests}
    assert all(r.num_output_tokens == wanted[r.request_id] for r in run.requests)


def test_static_batches_are_capped_by_contiguous_regions():
    """Each static request reserves max_model_len: the pool holds that many regions."""
    workload = chat_workload(150, "sharegpt", seed=2)
    config = EngineConfig(
        max_num_seqs=256, num_kv_blocks=1000, max_model_len=1600, scheduling_policy="static"
    )
    run = simulate(config, Deployment(LLAMA_8B, H200), replace_lengths(workload, 1600))
    regions = 1000 // 100  # 1600 tokens = 100 blocks of 16
    assert max(len(s.prefill_ids) + len(s.decode_ids) for s in run.steps) == regions
    continuous = simulate(
        replace(config, scheduling_policy="continuous"),
        Deployment(LLAMA_8B, H200),
        replace_lengths(workload, 1600),
    )
    assert max(len(s.prefill_ids) + len(s.decode_ids) for s in continuous.steps) > regions


def replace_lengths(workload: Workload, max_len: int) -> Workload:
    """Clip each request to ``max_len`` tokens in all."""
    requests = []
    for r in workload.requests:
        prompt = r.prompt_token_ids[: max_len // 2]
        requests.append(
            replace(r, prompt_token_ids=prompt, max_tokens=min(r.max_tokens, max_len // 2))
        )
    return Workload(workload.name, requests)


@pytest.mark.parametrize("router", ["round-robin", "least-loaded"])
def test_replicas_share_the_load(router):
    workload = chat_workload(400, "alpaca", request_rate=100.0, seed=4)
    config = EngineConfig(max_model_len=2048)
    one = simulate(config, Deployment(LLAMA_8B, get_hardware("l4")), workload, False)
    four = simulate(
        config, Deployment(LLAMA_8B, get_hardware("l4"), num_replicas=4, router=router), workload
    )
    assert sorted(r.request_id for r in four.requests) == sorted(r.request_id for r in one.requests)
    assert four.summary.ttft.p99 < one.summary.ttft.p99


def test_search_finds_the_fewest_replicas_that_meet_the_target():
    workload = chat_workload(300, "alpaca", request_rate=60.0, seed=5)
    config = EngineConfig(max_model_len=2048)
    deployment = Deployment(LLAMA_8B, get_hardware("l4"), router="least-loaded")
    target = 0.5
    found = search_replicas(config, deployment, workload, target, max_replicas=16)
    n = found.num_replicas
    assert n is not None and n > 1
    assert found.tried[n] <= target
    fewer = simulate(config, replace(deployment, num_replicas=n - 1), workload, False)
    assert fewer.summary.ttft.p99 > target


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit.*tensor-parallel-size"):
        simulate(EngineConfig(), Deployment(get_model("llama-3.1-70b"), H200), chat_workload(2))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hardware", "h300"], "invalid choice: 'h300'"),
        (["--model", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["--router", "random"], "invalid choice: 'random'"),
        (["--lengths", "wiki"], "invalid choice: 'wiki'"),
    ],
)
def test_bad_presets_are_argparse_errors_listing_the_choices(flags, message, capsys):
    from minivllm.cli import main

    assert main(["simulate", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "choose from" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--tensor-parallel-size", "0"],
            "--tensor-parallel-size/-tp: must be a positive int, got '0'",
        ),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be in (0, 1]"),
        (["--num-replicas", "0"], "--num-replicas: must be a positive int"),
        (["--request-rate", "nan"], "--request-rate: must be a positive number or inf"),
        (["--model", "llama-3.1-70b"], "does not fit on 1 x h200"),
        (["--policy", "fifo"], "fifo"),
        (["--search-p99-ttft", "1"], "needs a finite --request-rate"),
        (["--prompt-len", "lognormal:1"], "bad length distribution"),
    ],
)
def test_bad_values_are_one_line_errors(flags, message, capsys):
    from minivllm.cli import main

    assert main(["simulate", "--num-prompts", "4", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_prints_bench_table_and_writes_json(tmp_path, capsys):
    import json

    from minivllm.cli import main

    out = tmp_path / "sim.json"
    argv = ["simulate", "--num-prompts", "50", "--request-rate", "20", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cont/static" in printed and "simulated seconds" in printed
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"static", "continuous"}
    assert len(data["runs"]["continuous"]["requests"]) == 50
