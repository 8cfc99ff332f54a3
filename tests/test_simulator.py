"""The simulator: the real schedulers on simulated time, replicas, search, the CLI."""

import gc
import time
from dataclasses import replace

import pytest

from minivllm.bench.runner import run_engine
from minivllm.bench.workloads import BenchRequest, LengthDistribution, Workload, synthetic
from minivllm.config import EngineConfig
from minivllm.kv_cache_manager import KVCacheManager
from minivllm.models.arithmetic import decode_flops, prefill_flops, request_flops
from minivllm.models.loader import load_hf_config, model_config_from_hf
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from minivllm.simulator.clock import SimClock
from minivllm.simulator.cluster import Deployment, search_replicas, simulate
from minivllm.simulator.cost_model import ChunkShape, step_cost
from minivllm.simulator.executor import SimulatedExecutor
from minivllm.simulator.hardware import get_hardware
from minivllm.simulator.models import get_model
from minivllm.simulator.workloads import chat_workload
from minivllm.static_scheduler import StaticBatchScheduler

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
        async_scheduling=False,  # as the simulator schedules
    )
    real = run_engine(config, workload, progress=False)
    shape = model_config_from_hf(load_hf_config(tiny_llama_path))
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
    # the bench's useful work: the prompt in one pass, then two decodes
    prefill_and_decodes = prefill_flops(LLAMA_8B, 100) + sum(
        decode_flops(LLAMA_8B, c) for c in (101, 102)
    )
    assert run.summary.model_flops == request_flops(LLAMA_8B, 100, 3) == prefill_and_decodes


def test_a_padded_step_costs_what_its_chunks_cost():
    """The executor sums a step from the model runner's inputs: a static batch's prefill,
    padding chunks included, costs what the cost model gives chunk by chunk."""
    config = EngineConfig(max_num_seqs=4, max_model_len=64)
    executor = SimulatedExecutor(LLAMA_8B, H200, config, SimClock())
    scheduler = StaticBatchScheduler(
        KVCacheManager(executor.num_kv_blocks, config.block_size), 4, config.max_model_len
    )
    for i, prompt_len in enumerate((5, 40, 17)):
        scheduler.add_request(Sequence(str(i), list(range(3, 3 + prompt_len)), SamplingParams()))
    out = scheduler.schedule()
    assert out.num_wasted_tokens == 35 + 23  # two prompts padded to the longest
    chunks = [ChunkShape(len(c.token_ids), c.context_len, c.sample) for c in out.chunks]
    executor.step_costs = []
    executor.execute_model(out)
    assert executor.step_costs == [step_cost(LLAMA_8B, H200, chunks)]
    assert executor.clock.now == executor.step_costs[0].seconds


def test_the_collector_settings_are_restored_after_a_simulation():
    before = gc.get_threshold()
    simulate(EngineConfig(), Deployment(LLAMA_8B, H200), chat_workload(3, "alpaca"))
    assert gc.get_threshold() == before


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
        (
            ["--tensor-parallel-size", "3"],
            "the model's 32 attention heads must be divisible by tensor_parallel_size=3",
        ),
        (["--tensor-parallel-size", "1024"], "tensor_parallel_size=1024"),
        (["--acceptance-rate", "0.5"], "--acceptance-rate needs --speculative-config"),
        (
            ["--speculative-config", '{"num_speculative_tokens": 3}'],  # static too, by default
            "speculative decoding needs the continuous scheduling policy",
        ),
        (
            [
                "--policy",
                "continuous",
                "--speculative-config",
                '{"num_speculative_tokens": 3}',
                "--acceptance-rate",
                "0.5,0.6",
            ],
            "must not increase",
        ),
        (
            [
                "--policy",
                "continuous",
                "--speculative-config",
                '{"num_speculative_tokens": 3}',
                "--acceptance-rate",
                "most",
            ],
            "bad acceptance rate 'most'",
        ),
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


# --- speculative decoding ----------------------------------------------------------------


def _spec_run(acceptance: str, num_prompts: int = 40):
    from minivllm.simulator.acceptance import AcceptanceProfile

    config = EngineConfig(max_model_len=2048, speculative_config={"num_speculative_tokens": 3})
    deployment = Deployment(LLAMA_8B, H200, acceptance_profile=AcceptanceProfile.parse(acceptance))
    return simulate(config, deployment, chat_workload(num_prompts, "alpaca", seed=7))


def test_speculative_decoding_reports_the_acceptance_it_was_given():
    """vLLM's counters, from the real scheduler's bookkeeping: per-position rates near
    the profile's (40 requests, a few hundred verifications), never above the one
    before."""
    run = _spec_run("copy-heavy")
    spec = run.spec_decoding
    assert spec is not None and spec.num_drafts > 300
    rates = spec.acceptance_rate_per_pos
    assert rates == sorted(rates, reverse=True)
    assert rates[0] == pytest.approx(0.982, abs=0.05)
    assert spec.num_accepted_tokens == sum(spec.num_accepted_tokens_per_pos)
    wanted = sum(r.num_output_tokens for r in run.requests)
    assert wanted == chat_workload(40, "alpaca", seed=7).num_output_tokens  # exact lengths


def test_throughput_follows_the_acceptance():
    """Rejected drafts cost rows and give nothing; accepted ones give tokens for rows a
    memory-bound step barely notices."""
    plain = simulate(
        EngineConfig(max_model_len=2048), Deployment(LLAMA_8B, H200),
        chat_workload(40, "alpaca", seed=7),
    )  # fmt: skip
    tput = {a: _spec_run(a).summary.output_throughput for a in ("0", "no-copy", "1")}
    assert tput["0"] < plain.summary.output_throughput < tput["no-copy"] < tput["1"]
    assert _spec_run("0").spec_decoding.num_accepted_tokens == 0


def test_cli_reports_spec_decode_metrics(tmp_path, capsys):
    import json

    from minivllm.cli import main

    out = tmp_path / "spec.json"
    argv = [
        "simulate", "--num-prompts", "20", "--lengths", "alpaca", "--policy", "continuous",
        "--speculative-config", '{"num_speculative_tokens": 2}', "--acceptance-rate",
        "copy-heavy", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "SpecDecoding metrics: Mean acceptance length" in printed
    assert "simulated acceptance: copy-heavy (per draft position 0.982, 0.954)" in printed
    data = json.loads(out.read_text())
    spec = data["runs"]["continuous"]["spec_decode"]
    assert spec["spec_decode_num_drafts"] > 0 and spec["spec_decode_acceptance_rate"] > 0.8
    assert data["deployment"]["acceptance_profile"]["name"] == "copy-heavy"
    assert data["command"].startswith("minivllm ")


def test_acceptance_profiles():
    import random

    from minivllm.simulator.acceptance import AcceptanceProfile

    geometric = AcceptanceProfile.parse("0.5")
    assert [geometric.rate_at(i) for i in range(3)] == [0.5, 0.25, 0.125]
    listed = AcceptanceProfile.parse("0.8,0.4")  # later positions keep halving
    assert [listed.rate_at(i) for i in range(4)] == [0.8, 0.4, 0.2, 0.1]
    assert AcceptanceProfile.parse("copy-heavy").rate_per_pos == (0.982, 0.954, 0.922)
    for bad in ("1.5", "-0.1", "0.3,0.6"):
        with pytest.raises(ValueError):
            AcceptanceProfile.parse(bad)
    # one draw per verification: over many, each position is accepted at its rate
    rng = random.Random(0)
    draws = [listed.num_accepted(3, rng) for _ in range(20_000)]
    for position, rate in enumerate([0.8, 0.4, 0.2]):
        assert sum(n > position for n in draws) / len(draws) == pytest.approx(rate, abs=0.01)
    assert {AcceptanceProfile.parse("1").num_accepted(3, rng) for _ in range(10)} == {3}
    assert {AcceptanceProfile.parse("0").num_accepted(3, rng) for _ in range(10)} == {0}
