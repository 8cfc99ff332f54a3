"""The token budget's trade-off: first tokens sooner or smoother decoding, measured.

    python benchmarks/token_budget.py [--budgets 64,128,256,512,1024,2048]
        [--num-prompts 10] [--prompt-len uniform:128:1024] [--output-len 32]
        [--max-num-seqs 4] [--threads 1] [--plot-file token_budget.png] [--json PATH]

One seeded, mixed workload runs under the continuous policy once per
``max_num_batched_tokens`` (the token budget of one step). All requests arrive at t=0 but
only ``--max-num-seqs`` run at once, so every time one finishes, a new prompt joins a step
in which the others decode. That step computes the decodes *and* a prefill chunk of up to
the budget, and the decodes' tokens come out only when the whole step is done: a big
budget makes those decodes wait (a long inter-token gap), a small one spreads the prompt
over more steps (the new request's first token comes later). The script prints TTFT,
"prefill" (first scheduled to first token: TTFT without the time queued for a slot), TPOT
and ITL (P50 and P99, nearest rank) per budget, and draws them against the budget.
Sarathi-Serve (Agrawal et al., OSDI 2024) calls the small-chunk end "stall-free batching".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minivllm.bench.command import build_workload
from minivllm.bench.metrics import LatencyStats
from minivllm.bench.runner import run_engine
from minivllm.entrypoints import cli_args

# "prefill": from first scheduled to first token, i.e. TTFT without the time spent queued
# for a slot: what the budget changes directly.
ROWS = [("TTFT", "ttft"), ("prefill", "prefill"), ("TPOT", "tpot"), ("ITL", "itl")]


def measure(args: argparse.Namespace) -> list[dict]:
    """One run per budget; per run the budget, the throughput and P50 / P99 latencies."""
    from minivllm.models.loader import load_hf_config, load_tokenizer
    from minivllm.models.model_files import default_model_path

    model = args.model or str(default_model_path())
    workload = build_workload(args, load_tokenizer(model), load_hf_config(model).vocab_size)
    print(workload.describe())
    results = []
    for budget in args.budgets:
        config = cli_args.engine_config_from_args(
            args,
            max_num_batched_tokens=budget,
            scheduling_policy="continuous",
            max_model_len=args.max_model_len or workload.max_request_len,
        )
        run = run_engine(config, workload, progress=not args.no_progress)
        s = run.summary
        row = {"max_num_batched_tokens": budget, "output_throughput": s.output_throughput}
        prefill = [r.metrics.ttft - r.metrics.queue_time for r in run.requests]
        for _, name in ROWS:
            stats = LatencyStats.of(prefill) if name == "prefill" else getattr(s, name)
            row[name] = {"p50": stats.p50, "p99": stats.p99}
        results.append(row)
        print(format_row(row), flush=True)
    return results


def format_row(row: dict) -> str:
    cells = [f"{row['max_num_batched_tokens']:>6}", f"{row['output_throughput']:>9.1f}"]
    for _, name in ROWS:
        cells += [f"{row[name]['p50'] * 1e3:>9.0f}", f"{row[name]['p99'] * 1e3:>9.0f}"]
    return " ".join(cells)


def header() -> str:
    names = ["budget", "tokens/s"] + [f"{label} {p}" for label, _ in ROWS for p in ("P50", "P99")]
    return " ".join(f"{n:>9}" if i else f"{n:>6}" for i, n in enumerate(names)) + "   (ms)"


def plot(results: list[dict], path: Path) -> Path:
    """TTFT on the left, TPOT and ITL on the right, both against the budget (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [r["max_num_batched_tokens"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    series = {left: [("TTFT", "ttft", "#f28e2b"), ("prefill", "prefill", "#b07aa1")]}
    series[right] = [("ITL", "itl", "#4e79a7"), ("TPOT", "tpot", "#59a14f")]
    for ax, lines in series.items():
        for label, name, colour in lines:
            for p, style in (("p50", "-"), ("p99", "--")):
                values = [r[name][p] for r in results]
                ax.plot(budgets, values, style, marker="o", color=colour, label=f"{label} {p}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("max_num_batched_tokens (token budget per step)")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        # Above the axes, so the legend never covers a point.
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, frameon=False)
    left.set_title("first token (prefill: TTFT minus queueing)", pad=42, fontsize=10)
    right.set_title("between tokens", pad=42, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    from minivllm.bench.command import add_bench_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--budgets",
        type=lambda text: [int(b) for b in text.split(",")],
        default=[64, 128, 256, 512, 1024, 2048],
        help="comma-separated max_num_batched_tokens values",
    )
    add_bench_arguments(parser)
    # The policy is always continuous (the static one has no token budget).
    cli_args.add_engine_args(parser, exclude=("max_num_batched_tokens", "scheduling_policy"))
    parser.add_argument("--plot-file", default="token_budget.png", help="the figure's path")
    parser.set_defaults(
        num_prompts=10, prompt_len="uniform:128:1024", output_len="32", max_num_seqs=4, threads=1
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    print(header())
    results = measure(args)
    print("wrote", plot(results, Path(args.plot_file)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
