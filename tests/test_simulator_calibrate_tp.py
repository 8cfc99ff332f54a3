"""Calibrating the simulator's tensor-parallel term: the link fit recovers a known
latency and bandwidth from synthetic timings; a real calibration on three ranks pairs
every real step with a simulated one and leaves no process behind."""

from __future__ import annotations

import math

import psutil
import pytest

from minivllm.bench.hardware_probe import fit_ring_allreduce
from minivllm.simulator.calibrate import calibrate, format_report

SIZES = [2048, 524288, 4194304]


def ring_seconds(num_bytes: int, latency: float, bandwidth: float, tp: int) -> float:
    """The cost model's ring all-reduce, written out independently."""
    hops = 2 * (tp - 1)
    return hops * latency + hops / tp * num_bytes / bandwidth


@pytest.mark.parametrize("tp", [2, 3, 9])
@pytest.mark.parametrize("latency,bandwidth", [(5e-4, 2e9), (2e-6, 450e9), (1e-3, 1e8)])
def test_link_fit_recovers_latency_and_bandwidth_of_synthetic_timings(tp, latency, bandwidth):
    seconds = [ring_seconds(b, latency, bandwidth, tp) for b in SIZES]
    fitted_latency, fitted_bandwidth = fit_ring_allreduce(SIZES, seconds, tp)
    assert math.isclose(fitted_latency, latency, rel_tol=1e-6)
    assert math.isclose(fitted_bandwidth, bandwidth, rel_tol=1e-6)


def test_link_fit_reads_noise_as_no_bandwidth_limit_and_refuses_one_rank():
    # The larger messages were no slower (a busy machine's noise): no bandwidth term.
    latency, bandwidth = fit_ring_allreduce(SIZES, [4e-3, 3.9e-3, 3.8e-3], tp=3)
    assert bandwidth == math.inf and latency > 0
    # Faster than free at size 0 (a negative intercept): no latency, not a negative one.
    latency, bandwidth = fit_ring_allreduce(SIZES, [2e-9 * b - 3e-6 for b in SIZES], tp=3)
    assert latency == 0.0 and 0 < bandwidth < math.inf
    with pytest.raises(ValueError, match="tp=1"):
        fit_ring_allreduce(SIZES, [1e-3] * 3, tp=1)


def live_children() -> list[psutil.Process]:
    """This process's descendants that are still running, bar multiprocessing's
    resource tracker (started once by the first spawn, it lives as long as we do)."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" not in " ".join(child.cmdline()):
                alive.append(child)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.slow  # the link probe and two engines, each spawning three ranks: ~1 min
def test_calibration_on_three_ranks_pairs_every_step_and_leaves_no_process(smollm2_path):
    before = {p.pid for p in live_children()}
    hardware, results = calibrate(("continuous",), num_requests=2, tensor_parallel_size=3)
    [result] = results
    assert result.measured.steps and len(result.step_errors) == len(result.measured.steps)
    assert len(result.simulated.steps) == len(result.measured.steps)
    assert all(math.isfinite(e) and e >= 0 for e in result.step_errors)
    assert hardware.link_latency_s > 0  # measured: gloo among processes is not free
    report = format_report(hardware, results, tensor_parallel_size=3)
    assert "tensor parallel 3: gloo all-reduce link, measured" in report
    assert "continuous" in report
    assert [p.pid for p in live_children() if p.pid not in before] == []
