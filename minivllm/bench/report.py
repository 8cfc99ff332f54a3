"""The side-by-side table, the plain-words conclusions and the JSON file of a benchmark."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from minivllm.bench.metrics import RunSummary
from minivllm.bench.runner import BenchRun

COLUMN_TITLES = {
    "static": "static",
    "continuous": "continuous",
    "hf-static": "HF generate",
    "hf-continuous": "HF gen_batch",
}
LATENCIES = [("queue", "queue_time"), ("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl")]
LATENCIES += [("E2E", "e2e_latency")]
# `format_table(brief=True)`: the rows that tell the story, for a short demo table.
BRIEF_ROWS = (
    "output tokens/s",
    "duration (s)",
    "TTFT p50 (ms)",
    "TPOT p50 (ms)",
    "ITL p99 (ms)",
    "E2E p99 (ms)",
    "padding waste (%)",
    "mean batch size",
    "max batch size",
    "preemptions",
)
# Which way is better for each row, said in the table next to the ratio column.
HIGHER_IS_BETTER = {
    "output tokens/s",
    "total tokens/s",
    "requests/s",
    "model GFLOP/s (useful work)",
    "KV utilisation (%)",
    "mean batch size",
    "max batch size",
    "prefix cache hit rate (%)",
}
NEUTRAL = {"max KV blocks used", "engine steps"}  # more or fewer is neither good nor bad


def _better(label: str) -> str:
    if label in NEUTRAL:
        return ""
    return "higher" if label in HIGHER_IS_BETTER else "lower"


def table_rows(summary: RunSummary) -> list[tuple[str, float | None, str]]:
    """(label, value, format) rows of one run, in display order."""
    s = summary
    rows = [
        ("output tokens/s", s.output_throughput, ".1f"),
        ("total tokens/s", s.total_token_throughput, ".1f"),
        ("requests/s", s.request_throughput, ".2f"),
        ("duration (s)", s.duration, ".1f"),
        ("model GFLOP/s (useful work)", s.model_gflops_per_s, ".1f"),
    ]
    for label, name in LATENCIES:
        stats = getattr(s, name)
        for stat in ("mean", "p50", "p90", "p99"):
            value = getattr(stats, stat)
            rows.append((f"{label} {stat} (ms)", None if value is None else value * 1e3, ".0f"))
    rows += [
        ("padding waste (%)", _percent(s.padding_waste), ".1f"),
        ("KV utilisation (%)", _percent(s.kv_utilization), ".1f"),
        ("mean batch size", s.mean_batch_size, ".1f"),
        ("max batch size", s.max_batch_size, "d"),
        ("max KV blocks used", s.max_kv_blocks_used, "d"),
        ("engine steps", s.num_steps, "d"),
        ("preemptions", s.num_preemptions, "d"),
    ]
    if s.prefix_cache_hit_rate is not None:
        rows.append(("prefix cache hit rate (%)", _percent(s.prefix_cache_hit_rate), ".1f"))
    return rows


def format_table(runs: list[BenchRun], brief: bool = False) -> str:
    """Metrics down, runs across; a continuous/static ratio column once both have run,
    with which way is better. Percentiles are nearest-rank (`LatencyStats`). ``brief``:
    only `BRIEF_ROWS`. A row no run measured (all "-", e.g. the engine's own counters
    of a server benchmarked over HTTP) is left out."""
    labels = [label for label, _, _ in table_rows(runs[0].summary)]
    titles: list[str] = []
    columns: list[list[str]] = []
    done: dict[str, list] = {}
    for run in runs:
        rows = table_rows(run.summary)
        done[run.name] = rows
        titles.append(COLUMN_TITLES.get(run.name, run.name))
        columns.append([_cell(value, fmt) for _, value, fmt in rows])
        if run.name in ("static", "continuous") and "static" in done and "continuous" in done:
            titles += ["cont/static", "better"]
            columns.append([_ratio(c, s) for c, s in zip(done["continuous"], done["static"])])
            columns.append([_better(label) for label in labels])
    measured = [any(_cell_measured(col[i]) for col in columns) for i in range(len(labels))]
    header = f"{'metric':<28}" + "".join(f"{t:>13}" for t in titles)
    lines = [header, "-" * len(header)]
    for i, label in enumerate(labels):
        if (brief and label not in BRIEF_ROWS) or not measured[i]:
            continue
        lines.append(f"{label:<28}" + "".join(f"{col[i]:>13}" for col in columns))
    return "\n".join(lines)


def _cell_measured(cell: str) -> bool:
    return cell not in ("-", "", "higher", "lower")


def conclusions(runs: list[BenchRun]) -> list[str]:
    """What the static and continuous runs measured, in plain words: throughput, the
    tail latency, how big a batch each policy reached, and why."""
    by_name = {run.name: run.summary for run in runs}
    static, cont = by_name.get("static"), by_name.get("continuous")
    if not (static and cont):
        return []
    speedup = cont.output_throughput / static.output_throughput
    p99_change = cont.e2e_latency.p99 / static.e2e_latency.p99 - 1
    tpot = f"TPOT P50 {_ms(cont.tpot.p50)} vs {_ms(static.tpot.p50)} ms"
    if cont.tpot.p50 and static.tpot.p50 and cont.tpot.p50 > static.tpot.p50:
        tpot += " (a decode that shares a step with a prefill chunk waits for it)"
    lines = [
        f"continuous batching made {cont.output_throughput:.1f} output tokens/s, static "
        f"{static.output_throughput:.1f}: {speedup:.2f}x the throughput.",
        f"P99 end-to-end latency {cont.e2e_latency.p99:.1f} s (continuous) vs "
        f"{static.e2e_latency.p99:.1f} s (static), {p99_change:+.0%}; {tpot}.",
    ]
    if static.max_batch_size is not None and cont.max_batch_size is not None:
        lines.append(
            f"batch sizes reached: static at most {static.max_batch_size} requests per step "
            f"(mean {static.mean_batch_size:.1f}), continuous at most {cont.max_batch_size} "
            f"(mean {cont.mean_batch_size:.1f}); padding waste static "
            f"{_percent(static.padding_waste):.0f} %, continuous "
            f"{_percent(cont.padding_waste):.0f} %."
        )
    return lines


def outputs_agree(runs: list[BenchRun], a: str, b: str) -> tuple[int, int] | None:
    """How many requests got the same greedy tokens under runs ``a`` and ``b``."""
    by_name = {run.name: run.output_token_ids for run in runs}
    if a not in by_name or b not in by_name:
        return None
    same = sum(by_name[a][rid] == tokens for rid, tokens in by_name[b].items())
    return same, len(by_name[b])


def write_json(path: str | Path, runs: list[BenchRun], context: dict) -> None:
    """Everything measured: context (command, config, workload), per-run summaries and
    the per-request latencies."""
    data = dict(context)
    data["runs"] = {run.name: _run_json(run) for run in runs}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))


def _run_json(run: BenchRun) -> dict:
    requests = [
        {
            "request_id": r.request_id,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "queue_time": r.metrics.queue_time,
            "ttft": r.metrics.ttft,
            "tpot": r.metrics.tpot,
            "e2e_latency": r.metrics.e2e_latency,
        }
        for r in run.requests
    ]
    spec = run.spec_decoding
    return {
        "summary": asdict(run.summary),
        "requests": requests,
        "spec_decode": spec.as_dict() if spec is not None else None,
    }


def _ratio(cont_row: tuple, static_row: tuple) -> str:
    cont, static = cont_row[1], static_row[1]
    return "-" if cont is None or not static else f"{cont / static:.2f}x"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def command_line() -> str | None:
    """The command that produced a result, as one would type it again."""
    return "minivllm " + shlex.join(sys.argv[1:]) if sys.argv else None


def print_and_save(
    runs: list[BenchRun],
    context: dict,
    json_path: str | None = None,
    plot_dir: str | None = None,
    notes: list[str] | tuple[str, ...] = (),
    brief: bool = False,
    write_plots: Callable[[list[BenchRun], str], list] | None = None,
) -> None:
    """The end of ``minivllm bench`` and ``minivllm simulate``: the title and the table,
    the command's ``notes``, each speculating run's acceptance (vLLM's log line), then
    the JSON file and the plots (bench's `plots.write_all` unless ``write_plots``)."""
    print()
    print(context["title"])
    print(format_table(runs, brief=brief))
    for line in notes:
        print(line)
    for run in runs:
        if run.spec_decoding is not None:
            print(f"\n{run.name}: {run.spec_decoding.log_line()}")
    if json_path:
        write_json(json_path, runs, context)
        print(f"\nJSON: {json_path}")
    if plot_dir:
        if write_plots is None:
            from minivllm.bench.plots import write_all as write_plots
        paths = write_plots(runs, plot_dir)
        print("plots: " + ", ".join(str(p) for p in paths))
