"""The benchmark's pictures (matplotlib, written as PNG by ``minivllm bench --plot DIR``).

- timeline.png: one row per request, time on the x-axis, coloured by what the request
  was doing (queued, prefill, decode, padding, preempted); one panel per policy, stacked
  on a shared time axis, so static batching's padding bubbles and continuous batching's
  join-any-time flow are visible at a glance;
- batch_kv.png: sequences per step and KV blocks in use over time;
- latency_cdf.png: CDFs of TTFT and end-to-end latency for every run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from minivllm.bench.runner import BenchRun
from minivllm.utils import cdiv

COLOURS = {
    "queued": "#d9d9d9",
    "prefill": "#f28e2b",
    "decode": "#4e79a7",
    "padding": "#e15759",
    "preempted": "#b07aa1",
}

# Legends beside the axes, never on top of a curve.
OUTSIDE_RIGHT = dict(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)


def write_all(runs: list[BenchRun], out_dir: str | Path) -> list[Path]:
    """Draw every picture the runs allow into ``out_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine_runs = [run for run in runs if run.steps]
    paths = []
    if engine_runs:
        paths.append(plot_timeline(engine_runs, out_dir / "timeline.png"))
        paths.append(plot_batch_and_kv(engine_runs, out_dir / "batch_kv.png"))
    paths.append(plot_latency_cdfs(runs, out_dir / "latency_cdf.png"))
    return paths


def request_intervals(run: BenchRun) -> dict[str, list[tuple[float, float, str]]]:
    """Per request: (start, end, state) intervals in seconds since the run started.

    A step that computed a prefill chunk, a decode or padding for a request colours the
    step's whole duration; consecutive steps of one state merge into one interval."""
    t0 = run.start_time
    intervals: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for r in run.requests:
        if r.metrics.first_scheduled_time is not None:
            intervals[r.request_id].append(
                (r.metrics.arrival_time - t0, r.metrics.first_scheduled_time - t0, "queued")
            )
    preempted_at: dict[str, float] = {}
    for step in run.steps:
        start, end = step.start_time - t0, step.end_time - t0
        states = {rid: "padding" for rid in step.padding_ids}  # real work wins over padding
        states |= {rid: "prefill" for rid in step.prefill_ids}
        states |= {rid: "decode" for rid in step.decode_ids}
        for rid, state in states.items():
            if rid in preempted_at:
                intervals[rid].append((preempted_at.pop(rid), start, "preempted"))
            _extend(intervals[rid], start, end, state)
        for rid in step.preempted_ids:
            preempted_at[rid] = end
    return intervals


def _extend(spans: list[tuple[float, float, str]], start: float, end: float, state: str) -> None:
    if spans and spans[-1][2] == state:
        spans[-1] = (spans[-1][0], end, state)  # the gap between two steps is bookkeeping
    else:
        spans.append((start, end, state))


def plot_timeline(runs: list[BenchRun], path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_requests = max(len(run.requests) for run in runs)
    height = max(3.0, 0.12 * num_requests + 1.2)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height * len(runs)), sharex=True)
    for ax, run in zip(np.atleast_1d(axes), runs):
        intervals = request_intervals(run)
        order = sorted(intervals, key=_request_order)
        for row, rid in enumerate(order):
            by_state = defaultdict(list)
            for start, end, state in intervals[rid]:
                by_state[state].append((start, end - start))
            for state, spans in by_state.items():
                ax.broken_barh(spans, (row - 0.4, 0.8), color=COLOURS[state], linewidth=0)
        s = run.summary
        ax.set_title(
            f"{run.name}: {s.output_throughput:.1f} output tok/s, "
            f"P99 e2e {s.e2e_latency.p99:.1f} s, padding waste {100 * (s.padding_waste or 0):.0f} %"
        )
        ax.set_ylabel("request")
        ax.set_ylim(len(order) - 0.5, -0.5)
    legend = [Patch(color=colour, label=state) for state, colour in COLOURS.items()]
    fig.legend(handles=legend, loc="upper right", ncol=len(COLOURS))
    np.atleast_1d(axes)[-1].set_xlabel("time since start (s)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_batch_and_kv(runs: list[BenchRun], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (batch_ax, kv_ax) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True)
    for run in runs:
        # Counts are taken after each step; drawn from the step's start, they show (up to
        # the requests that finished in it) what the step ran with.
        times = [step.start_time - run.start_time for step in run.steps]
        real = [len(step.prefill_ids) + len(step.decode_ids) for step in run.steps]
        (line,) = batch_ax.step(times, real, where="post", label=f"{run.name}: real sequences")
        if any(step.num_padding_tokens for step in run.steps):
            # A static slot is busy until its batch ends: real work + finished-but-padding.
            slots = [
                n + len(set(s.padding_ids) - set(s.prefill_ids)) for n, s in zip(real, run.steps)
            ]
            batch_ax.step(
                times, slots, where="post", ls="--", color=line.get_color(),
                label=f"{run.name}: slots incl. padding",
            )  # fmt: skip
        used = [step.num_kv_blocks_used for step in run.steps]
        kv_ax.step(times, used, where="post", color=line.get_color(), label=f"{run.name}: in use")
        if run.block_size:
            needed = [cdiv(step.num_kv_tokens_stored, run.block_size) for step in run.steps]
            kv_ax.step(
                times, needed, where="post", ls=":", color=line.get_color(),
                label=f"{run.name}: holding real tokens",
            )  # fmt: skip
    batch_ax.set_ylabel("sequences per step")
    batch_ax.legend(**OUTSIDE_RIGHT)
    kv_ax.set_ylabel("KV blocks")
    kv_ax.set_xlabel("time since start (s)")
    kv_ax.legend(**OUTSIDE_RIGHT)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(runs: list[BenchRun], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, (title, attr) in zip(axes, [("TTFT", "ttft"), ("end-to-end latency", "e2e_latency")]):
        for run in runs:
            values = np.sort([getattr(r.metrics, attr) for r in run.requests])
            fraction = np.arange(1, len(values) + 1) / len(values)
            ax.step(values, fraction, where="post", label=run.name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(**OUTSIDE_RIGHT)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _request_order(request_id: str):
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)
