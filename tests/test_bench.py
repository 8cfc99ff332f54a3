"""`minivllm bench`: seeded workloads, the online driver, and the command end to end on
the tiny model (JSON and plots written). Nothing here times anything."""

from __future__ import annotations

import json

import pytest

from minivllm.bench import workloads
from minivllm.bench.runner import run_engine
from minivllm.bench.workloads import LengthDistribution
from minivllm.cli import main
from minivllm.config import EngineConfig

HETEROGENEOUS = (
    LengthDistribution.parse("uniform:16:400"),
    LengthDistribution.parse("uniform:8:128"),
)


def lengths(workload):
    return [(len(r.prompt_token_ids), r.max_tokens) for r in workload.requests]


def test_synthetic_workload_is_seeded():
    prompt_len = LengthDistribution.parse("uniform:16:400")
    output_len = LengthDistribution.parse("uniform:8:128")
    a = workloads.synthetic(32, prompt_len, output_len, (17, 1000), seed=3)
    b = workloads.synthetic(32, prompt_len, output_len, (17, 1000), seed=3)
    c = workloads.synthetic(32, prompt_len, output_len, (17, 1000), seed=4)
    assert a == b
    assert lengths(a) != lengths(c)
    assert all(16 <= p <= 400 and 8 <= o <= 128 for p, o in lengths(a))
    assert all(17 <= t < 1000 for r in a.requests for t in r.prompt_token_ids)
    assert len(set(lengths(a))) > 20  # heterogeneous


@pytest.mark.parametrize(
    "spec, expected",
    [("7", [7, 7, 7]), ("fixed:5", [5, 5, 5]), ("uniform:3:3", [3, 3, 3])],
)
def test_length_distributions(spec, expected):
    import numpy as np

    assert LengthDistribution.parse(spec).sample(np.random.default_rng(0), 3) == expected


def test_lognormal_lengths_stay_in_bounds():
    import numpy as np

    dist = LengthDistribution.parse("lognormal:100:1.5:10:300")
    values = dist.sample(np.random.default_rng(0), 500)
    assert min(values) == 10 and max(values) == 300


@pytest.mark.parametrize("spec", ["uniform:5", "normal:3:4", "x", "uniform:0:4", ""])
def test_bad_length_distribution(spec):
    with pytest.raises(ValueError, match="length distribution"):
        LengthDistribution.parse(spec)


def test_poisson_arrivals_are_seeded_and_keep_lengths():
    base = workloads.synthetic(200, *HETEROGENEOUS, (3, 256), seed=0)
    online = base.with_poisson_arrivals(10.0, seed=0)
    assert online == base.with_poisson_arrivals(10.0, seed=0)
    assert lengths(online) == lengths(base)
    times = [r.arrival_time for r in online.requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert 0.07 < times[-1] / (len(times) - 1) < 0.13  # mean gap ~ 1 / rate


def test_shared_system_prompt_workload():
    w = workloads.shared_system_prompt(5, 32, *HETEROGENEOUS, (3, 256), seed=0)
    system = w.requests[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == system for r in w.requests)
    assert len({tuple(r.prompt_token_ids[32:40]) for r in w.requests}) == 5


def test_jsonl_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "w1 w2 w3", "max_tokens": 4}\n\n{"prompt_token_ids": [5, 6]}\n')
    tokenize = lambda text: [len(word) for word in text.split()]
    w = workloads.from_jsonl(path, tokenize, LengthDistribution.parse("128"))
    assert [r.prompt_token_ids for r in w.requests] == [[2, 2, 2], [5, 6]]
    assert [r.max_tokens for r in w.requests] == [4, 128]


def test_online_requests_enter_at_their_arrival_time(tiny_llama_path):
    w = workloads.synthetic(
        6, LengthDistribution.parse("uniform:4:20"), LengthDistribution.parse("3"), (3, 256)
    )
    w = w.with_poisson_arrivals(40.0, seed=1)
    config = EngineConfig(model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=64)
    run = run_engine(config, w, progress=False)
    arrivals = {r.request_id: r.arrival_time for r in w.requests}
    assert len(run.requests) == 6
    for r in run.requests:
        assert r.metrics.arrival_time == pytest.approx(run.start_time + arrivals[r.request_id])
        assert r.metrics.queue_time >= 0 and r.num_output_tokens == 3


def test_max_concurrency_limits_requests_in_flight(tiny_llama_path):
    w = workloads.synthetic(
        5, LengthDistribution.parse("8"), LengthDistribution.parse("4"), (3, 256)
    )
    config = EngineConfig(model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=64)
    run = run_engine(config, w, max_concurrency=2, progress=False)
    assert max(s.num_running + s.num_waiting for s in run.steps) <= 2
    assert len(run.requests) == 5


def test_bench_command_end_to_end(tiny_llama_path, tmp_path, capsys):
    json_path, plot_dir = tmp_path / "bench.json", tmp_path / "plots"
    argv = ["bench", "--model", str(tiny_llama_path), "--num-prompts", "6"]
    argv += ["--prompt-len", "uniform:4:30", "--output-len", "uniform:2:12", "--max-num-seqs", "3"]
    argv += ["--num-kv-blocks", "128", "--no-progress", "--compare-hf"]
    argv += ["--json", str(json_path), "--plot", str(plot_dir)]
    assert main(argv) == 0

    table = capsys.readouterr().out
    for title in ("static", "continuous", "cont/static", "HF generate", "HF gen_batch"):
        assert title in table
    assert "greedy outputs identical under both policies: 6/6" in table
    assert "x the throughput." in table and "batch sizes reached: static at most" in table
    for internal in ("target", "MISSED", "issue"):  # measured facts only
        assert internal not in table
    data = json.loads(json_path.read_text())
    assert set(data["runs"]) == {"static", "continuous", "hf-static", "hf-continuous"}
    for run in data["runs"].values():
        assert run["summary"]["num_output_tokens"] == data["workload"]["num_output_tokens"]
        assert len(run["requests"]) == 6
    static, continuous = data["runs"]["static"]["summary"], data["runs"]["continuous"]["summary"]
    for key in ("output_throughput", "ttft", "tpot", "itl", "e2e_latency", "kv_utilization"):
        assert continuous[key] is not None
    assert set(continuous["e2e_latency"]) == {"mean", "p50", "p90", "p99"}
    assert static["padding_waste"] > 0 and continuous["padding_waste"] == 0
    assert "targets" not in data
    assert static["max_batch_size"] <= 3 and continuous["max_batch_size"] <= 3
    for name in ("timeline.png", "batch_kv.png", "latency_cdf.png"):
        assert (plot_dir / name).stat().st_size > 0


def test_bench_rejects_unknown_policy(tiny_llama_path, capsys):
    assert main(["bench", "--model", str(tiny_llama_path), "--policy", "static,dynamic"]) == 2
    assert "unknown scheduling policy 'dynamic'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_smoke_on_smollm2(tmp_path, capsys):
    argv = ["bench", "--num-prompts", "4", "--prompt-len", "uniform:8:40", "--output-len", "4"]
    argv += ["--max-num-seqs", "2", "--no-progress", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["runs"]["continuous"]["summary"]["num_output_tokens"] == 16


def test_prefix_cache_hit_rate_is_reported(tiny_llama_path, tmp_path):
    json_path = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama_path), "--policy", "continuous"]
    argv += ["--workload", "shared-prefix", "--system-prompt-len", "32", "--num-prompts", "4"]
    argv += ["--prompt-len", "uniform:4:8", "--output-len", "2", "--max-num-seqs", "2"]
    argv += ["--num-kv-blocks", "64", "--enable-prefix-caching", "--no-progress"]
    assert main(argv + ["--json", str(json_path)]) == 0
    summary = json.loads(json_path.read_text())["runs"]["continuous"]["summary"]
    # The first request computes the shared 32 tokens (2 blocks); the other three find them.
    assert 0 < summary["prefix_cache_hit_rate"] < 1


def test_same_kv_memory_static_is_capped_by_regions_paging_by_real_length(tiny_llama_path):
    """16 blocks of 16 slots. Static reserves max_model_len = 64 slots (4 blocks) per
    request, so at most 4 run at once; paging gives each 12-token request one block, so
    the batch cap (8) binds instead."""
    w = workloads.synthetic(
        8, LengthDistribution.parse("8"), LengthDistribution.parse("4"), (3, 256)
    )
    runs = {}
    for policy in ("static", "continuous"):
        config = EngineConfig(
            model=str(tiny_llama_path),
            num_kv_blocks=16,
            max_model_len=64,
            max_num_seqs=8,
            scheduling_policy=policy,
        )
        runs[policy] = run_engine(config, w, progress=False).summary
    assert runs["static"].max_batch_size == 4
    assert runs["continuous"].max_batch_size == 8
    assert runs["continuous"].num_steps < runs["static"].num_steps


def test_bench_kv_cache_memory_takes_units(tiny_llama_path, tmp_path):
    json_path = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama_path), "--num-prompts", "2", "--brief"]
    argv += ["--prompt-len", "4", "--output-len", "2", "--kv-cache-memory", "1MiB"]
    assert main(argv + ["--no-progress", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["engine_config"]["kv_cache_memory_bytes"] == 2**20


def test_bench_rejects_a_bad_memory_size(tiny_llama_path, capsys):
    assert main(["bench", "--model", str(tiny_llama_path), "--kv-cache-memory", "lots"]) == 2
    assert "bad memory size 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_no_measured_step_carries_a_warm_up_request(tiny_llama_path, async_scheduling):
    """With async scheduling the warm-up's last step is still in flight when its requests
    are done: the run drains it before measuring, so every measured step holds only the
    workload's requests, and the first one starts after the measurement does."""
    w = workloads.synthetic(
        4, LengthDistribution.parse("8"), LengthDistribution.parse("5"), (3, 256)
    )
    config = EngineConfig(
        model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=64,
        attention_backend="torch", async_scheduling=async_scheduling,
    )  # fmt: skip
    run = run_engine(config, w, progress=False)
    workload_ids = {r.request_id for r in w.requests}
    for step in run.steps:
        ids = {*step.prefill_ids, *step.decode_ids, *step.preempted_ids}
        assert ids <= workload_ids, ids - workload_ids
    assert run.steps[0].start_time >= run.start_time
    assert sum(s.num_generation_tokens for s in run.steps) == 4 * 5
