"""``minivllm simulate``: bench's comparison on simulated hardware, capacity search, and
the calibration of the cost model against this CPU."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, replace

from minivllm.bench import workloads
from minivllm.config import SCHEDULING_POLICIES
from minivllm.entrypoints import cli_args
from minivllm.simulator import acceptance
from minivllm.simulator.cluster import ROUTERS
from minivllm.simulator.hardware import HARDWARE_CHOICES
from minivllm.simulator.models import MODELS
from minivllm.simulator.workloads import CHAT_LENGTHS

NOT_SIMULATED = (
    "model",
    "scheduling_policy",
    "kv_cache_memory_bytes",
    "attention_backend",
    "dtype",
    "device",
    "seed",
    "tensor_parallel_size",  # the deployment's own --tensor-parallel-size below
    "async_scheduling",  # the simulated clock charges the GPU's time only: nothing to overlap
)
TIMELINE_REQUESTS = 60  # the timeline plot draws the first requests only: one row each


def add_simulate_arguments(sim: argparse.ArgumentParser) -> None:
    d = sim.add_argument_group("deployment")
    d.add_argument("--hardware", default="h200", choices=HARDWARE_CHOICES)
    d.add_argument("--model", default="llama-3.1-8b", choices=list(MODELS))
    d.add_argument("--tensor-parallel-size", "-tp", type=cli_args.positive_int, default=1)
    d.add_argument("--gpu-memory-utilization", type=cli_args.fraction, default=0.9)
    d.add_argument("--num-replicas", type=cli_args.positive_int, default=1)
    d.add_argument("--router", default="round-robin", choices=ROUTERS)
    w = sim.add_argument_group("workload")
    w.add_argument("--num-prompts", type=cli_args.positive_int, default=1000)
    w.add_argument(
        "--request-rate", type=cli_args.rate, default=math.inf, help="Poisson, requests/s"
    )
    w.add_argument(
        "--lengths", default="sharegpt", choices=list(CHAT_LENGTHS), help="length preset"
    )
    w.add_argument(
        "--prompt-len",
        type=workloads.length_distribution,
        default=None,
        help="override: N, uniform:LO:HI, lognormal:...",
    )
    w.add_argument(
        "--output-len",
        type=workloads.length_distribution,
        default=None,
        help="override, like --prompt-len",
    )
    w.add_argument("--workload-seed", type=cli_args.non_negative_int, default=0)
    s = sim.add_argument_group("speculative decoding (with --speculative-config)")
    s.add_argument(
        "--acceptance-rate",
        default=None,
        metavar="RATE",
        help="how many drafts the model would accept: a measured preset ("
        + ", ".join(acceptance.MEASURED)
        + f"; default {acceptance.DEFAULT}), one rate per draft given the ones before it "
        "were accepted (e.g. 0.7), or comma-separated rates per draft position",
    )
    m = sim.add_argument_group("modes")
    m.add_argument(
        "--search-p99-ttft",
        type=cli_args.positive_float,
        default=None,
        metavar="SECONDS",
        help="find the fewest replicas whose P99 TTFT at --request-rate is within this",
    )
    m.add_argument(
        "--max-replicas", type=cli_args.positive_int, default=64, help="for --search-p99-ttft"
    )
    m.add_argument(
        "--calibrate",
        action="store_true",
        help="run the real engine on SmolLM2 here and the simulator with this-cpu; compare",
    )
    sim.add_argument(
        "--policy",
        default="static,continuous",
        type=cli_args.comma_list(SCHEDULING_POLICIES, "scheduling policy"),
        help="comma-separated policies",
    )
    # The engine's own flags, generated from EngineConfig, minus what a simulation has no
    # use for (--model here names a preset, not a checkpoint). Defaults: a GPU server's.
    cli_args.add_engine_args(sim, exclude=NOT_SIMULATED)
    sim.set_defaults(max_num_seqs=256, max_num_batched_tokens=8192)
    o = sim.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write timeline/batch/CDF PNGs")
    o.add_argument("--brief", action="store_true", help="a short table: the key rows only")


def run_simulate(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    from minivllm.bench import report
    from minivllm.simulator.cluster import search_replicas, simulate

    policies = args.policy
    workload = _workload(args)
    max_model_len = args.max_model_len or workload.max_request_len
    configs = [_engine_config(args, policy, max_model_len) for policy in policies]
    deployment = _deployment(args)
    print(workload.describe(), file=sys.stderr)

    if args.search_p99_ttft is not None:
        return _search(args, configs, deployment, workload, search_replicas)

    runs = [simulate(config, deployment, workload) for config in configs]
    context = _context(args, configs[0], deployment, workload, runs[0].num_kv_blocks)
    notes = []
    spec = configs[0].speculative_config
    if spec is not None:
        profile = deployment.acceptance_profile
        rates = ", ".join(f"{profile.rate_at(i):.3f}" for i in range(spec.num_speculative_tokens))
        notes.append(
            f"\nsimulated acceptance: {profile.name} (per draft position {rates}); every "
            "decode carries drafts (the placeholder outputs always match an n-gram)"
        )
    report.print_and_save(
        runs, context, args.json, args.plot, notes, brief=args.brief, write_plots=write_plots
    )
    return 0


def _search(args, configs, deployment, workload, search_replicas) -> int:
    if not math.isfinite(args.request_rate):
        raise ValueError("--search-p99-ttft needs a finite --request-rate")
    target = args.search_p99_ttft
    print(
        f"\nreplicas of {deployment.tensor_parallel_size} x {deployment.hardware.name} "
        f"({deployment.model_name}, {deployment.router}) for {args.request_rate:g} req/s "
        f"at P99 TTFT <= {target:g} s"
    )
    for config in configs:
        found = search_replicas(config, deployment, workload, target, args.max_replicas)
        tried = ", ".join(f"{n}: {p99:.2f} s" for n, p99 in found.tried.items())
        answer = (
            f"{found.num_replicas} replicas ({found.num_replicas * deployment.tensor_parallel_size}"
            " devices)"
            if found.num_replicas
            else f"more than {args.max_replicas} replicas"
        )
        print(f"  {config.scheduling_policy:<11} {answer}; P99 TTFT by replicas: {tried}")
    return 0


def _calibrate(args) -> int:
    from minivllm.simulator.calibrate import calibrate, format_report

    policies, tp = tuple(args.policy), args.tensor_parallel_size
    if tp == 1:
        print("running the real engine on SmolLM2, then the simulator (under a minute, idle)...")
    else:
        print(
            f"timing all-reduces among {tp} processes, then the real engine on SmolLM2 on "
            f"{tp} ranks, then the simulator (a few minutes)..."
        )
    hardware, results = calibrate(policies, tensor_parallel_size=tp)
    print(format_report(hardware, results, tp))
    return 0


def _workload(args):
    from minivllm.simulator.workloads import chat_workload

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    return chat_workload(
        args.num_prompts,
        args.lengths,
        args.request_rate,
        args.workload_seed,
        args.prompt_len,
        args.output_len,
    )


def _deployment(args):
    """The deployment from the flags; a tensor-parallel split the real engine refuses
    fails here, before any work, with the engine's message."""
    from minivllm.simulator.acceptance import AcceptanceProfile
    from minivllm.simulator.cluster import Deployment
    from minivllm.simulator.hardware import get_hardware
    from minivllm.simulator.models import get_model

    if args.acceptance_rate is not None and args.speculative_config is None:
        raise ValueError("--acceptance-rate needs --speculative-config")
    return Deployment(
        get_model(args.model),
        get_hardware(args.hardware),
        args.tensor_parallel_size,
        args.gpu_memory_utilization,
        args.num_replicas,
        args.router,
        AcceptanceProfile.parse(args.acceptance_rate or acceptance.DEFAULT),
    )


def _engine_config(args, policy: str, max_model_len: int):
    """The engine's settings from the flags; no checkpoint (the executor is simulated)."""
    return cli_args.engine_config_from_args(
        args, model=None, scheduling_policy=policy, max_model_len=max_model_len,
        tensor_parallel_size=1,  # the simulated executor splits the model, not the engine
    )  # fmt: skip


def _context(args, config, deployment, workload, num_kv_blocks: int) -> dict:
    from minivllm.bench import report
    from minivllm.simulator.models import shape_json
    from minivllm.utils import cdiv

    mode = (
        "offline (all requests at t=0)"
        if not math.isfinite(args.request_rate)
        else f"online, Poisson {args.request_rate:g} req/s"
    )
    blocks_per_region = cdiv(config.max_model_len, config.block_size)
    title = (
        f"simulated: {deployment.model_name} on {deployment.num_replicas} replica(s) of "
        f"{deployment.tensor_parallel_size} {deployment.hardware.name} (tensor parallel), "
        f"router {deployment.router} | "
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}, max_model_len {config.max_model_len}, "
        f"{num_kv_blocks} KV blocks x {config.block_size} per replica (static: "
        f"{num_kv_blocks // blocks_per_region} max_model_len regions)\n"
        f"{workload.describe()} | {mode} | times are simulated seconds"
    )
    return {
        "title": title,
        "command": report.command_line(),
        "simulated": True,
        "deployment": {
            "model": shape_json(deployment.model),
            "hardware": asdict(deployment.hardware),
            "tensor_parallel_size": deployment.tensor_parallel_size,
            "gpu_memory_utilization": deployment.gpu_memory_utilization,
            "num_replicas": deployment.num_replicas,
            "router": deployment.router,
            "acceptance_profile": (
                asdict(deployment.acceptance_profile) if config.speculative_config else None
            ),
        },
        "engine_config": asdict(config) | {"num_kv_blocks": num_kv_blocks},
        "workload": {
            "description": workload.describe(),
            "num_requests": len(workload.requests),
            "num_prompt_tokens": workload.num_prompt_tokens,
            "num_output_tokens": workload.num_output_tokens,
            "mode": mode,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,
        },
    }


def write_plots(runs, out_dir) -> list:
    """bench's pictures; the timeline only for the first requests (one row each)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    from minivllm.bench import plots

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    first = [_first_requests(run, TIMELINE_REQUESTS) for run in runs]
    return [
        plots.plot_timeline(first, out_dir / "timeline.png"),
        plots.plot_batch_and_kv(runs, out_dir / "batch_kv.png"),
        plots.plot_latency_cdfs(runs, out_dir / "latency_cdf.png"),
    ]


def _first_requests(run, n: int):
    """The run restricted to its first ``n`` requests (by id), for the timeline."""
    keep = {str(i) for i in range(n)}
    requests = [r for r in run.requests if r.request_id in keep]
    last = max(r.metrics.finished_time for r in requests)

    def only(ids):
        return [rid for rid in ids if rid in keep]

    steps = [
        replace(
            s,
            prefill_ids=only(s.prefill_ids),
            decode_ids=only(s.decode_ids),
            padding_ids=only(s.padding_ids),
            preempted_ids=only(s.preempted_ids),
        )
        for s in run.steps
        if s.start_time <= last
    ]
    return replace(run, requests=requests, steps=steps)
