"""How wrong is the cost model? Run the real engine on SmolLM2 here, then the simulator
with ``this-cpu`` on the same workload, and compare step by step.

Both runs use the same scheduler on the same offline workload, so they make the same
decisions and their steps pair up one to one (checked: same requests prefilled, decoded
and padded in every step). For each pair the error is |predicted - measured| / measured;
the whole run's error compares output throughput.

``this-cpu`` is measured first (matmul rate on 1024 x 1024 matrices, memory read rate).
Two more figures are fitted, on a separate short real run with another seed, so that the
comparison is out of sample: a straight line through (roofline time, measured time) of
that run's steps. Its intercept is the per-step overhead (Python scheduling, sampling,
tensor set-up); its slope says how far below the measured peaks the model's own, much
smaller matmuls and its attention run, and becomes the preset's efficiency (1 / slope).

With ``tensor_parallel_size`` > 1 the real engine runs that many worker processes and
the simulator the same split; ``this-cpu``'s link (latency per hop, bandwidth) is
measured by timing gloo all-reduces among that many processes, and the fit above leaves
the all-reduce term alone: it explains only what the measured link does not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from minivllm.bench.runner import BenchRun, run_engine
from minivllm.bench.workloads import LengthDistribution, Workload, synthetic
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.models.arithmetic import check_tensor_parallel
from minivllm.simulator.cluster import Deployment, build_replica, simulate
from minivllm.simulator.cost_model import StepCost
from minivllm.simulator.hardware import Hardware, measure_this_cpu, with_overrides
from minivllm.simulator.models import get_model
from minivllm.stats import StepStats

SMOLLM2 = get_model("smollm2-135m")


def calibration_workload(num_requests: int = 8, seed: int = 0) -> Workload:
    """Short, varied requests: a real run of both policies takes well under a minute on
    an idle 2-core machine."""
    return synthetic(
        num_requests,
        LengthDistribution.parse("uniform:16:128"),
        LengthDistribution.parse("uniform:4:24"),
        token_range=(100, SMOLLM2.vocab_size),  # skip SmolLM2's special tokens
        seed=seed,
    )


@dataclass
class PolicyCalibration:
    policy: str
    measured: BenchRun
    simulated: BenchRun
    step_errors: list[float]  # |predicted - measured| / measured, per step

    @property
    def median_step_error(self) -> float:
        return statistics.median(self.step_errors)

    @property
    def p90_step_error(self) -> float:
        return float(np.percentile(self.step_errors, 90))

    @property
    def throughput_error(self) -> float:
        real = self.measured.summary.output_throughput
        return abs(self.simulated.summary.output_throughput - real) / real


def fit_step_model(
    hardware: Hardware,
    config: EngineConfig,
    workload: Workload,
    tp: int = 1,
    engine: LLMEngine | None = None,
) -> Hardware:
    """``hardware`` with the overhead and efficiency that best fit a real run of
    ``workload`` (least squares: measured - all-reduces = overhead + roofline time /
    efficiency; the all-reduce term is the measured link's, zero at ``tp`` = 1), run
    on ``engine`` or a fresh one."""
    real = run_engine(config, workload, progress=False, engine=engine)
    bare = with_overrides(hardware, step_overhead_s=0.0)
    costs = _predicted_step_costs(bare, _sim_config(config, real), workload, real, tp)
    roofline = [max(c.compute_s, c.memory_s) for c in costs]
    measured = [s.end_time - s.start_time - c.communication_s for s, c in zip(real.steps, costs)]
    slope, intercept = np.polyfit(roofline, measured, 1)
    efficiency = 1.0 / slope if slope > 0 else 1.0
    return with_overrides(
        hardware,
        flops_efficiency=efficiency,
        bandwidth_efficiency=efficiency,
        step_overhead_s=max(0.0, float(intercept)),
    )


def _predicted_step_costs(
    hardware: Hardware, config: EngineConfig, workload: Workload, real: BenchRun, tp: int
) -> list[StepCost]:
    """Replay ``workload`` in the simulator on ``tp`` devices; each step's predicted cost."""
    replica = build_replica(config, Deployment(SMOLLM2, hardware, tp))
    replica.executor.step_costs = []
    replica.engine.record_steps()
    prompt_lens = {r.request_id: len(r.prompt_token_ids) for r in workload.requests}
    for request in workload.requests:
        replica.add(request)
    while replica.is_busy:
        replica.step(prompt_lens)
    _check_same_decisions(real.steps, replica.engine.take_step_stats())
    return replica.executor.step_costs


def calibrate(
    policies: tuple[str, ...] = ("static", "continuous"),
    num_requests: int = 8,
    threads: int = 1,
    tensor_parallel_size: int = 1,
) -> tuple[Hardware, list[PolicyCalibration]]:
    """Measure this CPU with ``threads`` torch threads (1: steadiest on a shared machine),
    fit the step overhead, then compare real and simulated runs of each policy, both on
    ``tensor_parallel_size`` ranks (each real worker runs one torch thread)."""
    import torch

    torch.set_num_threads(threads)
    tp = tensor_parallel_size
    check_tensor_parallel(SMOLLM2.num_heads, SMOLLM2.num_kv_heads, tp)  # before any work
    fit_workload = calibration_workload(num_requests, seed=1)
    workload = calibration_workload(num_requests, seed=0)
    # Prefix caching off: the static policy refuses it, and random prompts share nothing.
    # One max_model_len for both workloads, so that the engine the fit runs on also runs
    # its policy's comparison (at tp > 1 every engine start spawns and loads tp workers).
    # Async scheduling off: a step's measured time must be that step's alone, not
    # overlapped with the scheduling of the next (the simulator schedules synchronously).
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        async_scheduling=False,
        tensor_parallel_size=tp,
        max_model_len=max(fit_workload.max_request_len, workload.max_request_len),
    )
    hardware = measure_this_cpu(tensor_parallel_size=tp)
    fit_engine = LLMEngine(config)
    try:
        hardware = fit_step_model(hardware, config, fit_workload, tp, fit_engine)
        results = [
            _compare(
                _with(config, scheduling_policy=policy),
                workload,
                hardware,
                tp,
                fit_engine if policy == config.scheduling_policy else None,
            )
            for policy in policies
        ]
    finally:
        fit_engine.close()
    return hardware, results


def _compare(
    config: EngineConfig,
    workload: Workload,
    hardware: Hardware,
    tp: int,
    engine: LLMEngine | None,
) -> PolicyCalibration:
    """Run ``workload`` on the real engine (``engine``, or a fresh one) and in the
    simulator on ``tp`` devices; each step's error."""
    measured = run_engine(config, workload, progress=False, engine=engine)
    simulated = simulate(_sim_config(config, measured), Deployment(SMOLLM2, hardware, tp), workload)
    _check_same_decisions(measured.steps, simulated.steps)
    errors = [
        abs((p.end_time - p.start_time) - (m.end_time - m.start_time)) / (m.end_time - m.start_time)
        for m, p in zip(measured.steps, simulated.steps)
    ]
    return PolicyCalibration(config.scheduling_policy, measured, simulated, errors)


def format_report(
    hardware: Hardware, results: list[PolicyCalibration], tensor_parallel_size: int = 1
) -> str:
    import torch

    lines = [
        f"this-cpu, measured: fp32 matmul {hardware.peak_flops / 1e9:.1f} GFLOP/s, memory read "
        f"{hardware.memory_bandwidth / 1e9:.1f} GB/s; fitted: step overhead "
        f"{hardware.step_overhead_s * 1e3:.1f} ms, efficiency {hardware.flops_efficiency:.2f} "
        f"of those rates ({torch.get_num_threads()} torch thread)",
        *_link_line(hardware, tensor_parallel_size),
        f"{'policy':<12}{'steps':>7}{'median step err':>17}{'P90 step err':>14}"
        f"{'real tok/s':>12}{'sim tok/s':>11}{'tput err':>10}",
    ]
    for r in results:
        lines.append(
            f"{r.policy:<12}{len(r.step_errors):>7}{r.median_step_error:>17.1%}"
            f"{r.p90_step_error:>14.1%}{r.measured.summary.output_throughput:>12.1f}"
            f"{r.simulated.summary.output_throughput:>11.1f}{r.throughput_error:>10.1%}"
        )
    return "\n".join(lines)


def _link_line(hardware: Hardware, tp: int) -> list[str]:
    if tp == 1:
        return []  # one rank: no link
    bandwidth = (
        "unmeasurable (no slower for larger messages)"
        if hardware.link_bandwidth == float("inf")
        else f"{hardware.link_bandwidth / 1e9:.2f} GB/s"
    )
    return [
        f"tensor parallel {tp}: gloo all-reduce link, measured: "
        f"{hardware.link_latency_s * 1e6:.0f} us per hop, bandwidth {bandwidth}"
    ]


def _check_same_decisions(real: list[StepStats], simulated: list[StepStats]) -> None:
    """The two runs must have made the same scheduling decisions, step for step."""
    if [_composition(s) for s in real] != [_composition(s) for s in simulated]:
        raise AssertionError("the simulated run scheduled differently from the real one")


def _composition(step: StepStats) -> tuple:
    return (step.prefill_ids, step.decode_ids, step.padding_ids, step.num_prefill_tokens)


def _sim_config(config: EngineConfig, real: BenchRun) -> EngineConfig:
    """The real run's engine settings with its KV pool size, on one engine process (the
    simulated executor splits the model, not the engine)."""
    return _with(config, num_kv_blocks=real.num_kv_blocks, tensor_parallel_size=1)


def _with(config: EngineConfig, **changes) -> EngineConfig:
    from dataclasses import replace

    return replace(config, **changes)
