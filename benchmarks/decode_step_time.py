"""Decode step time against the rows in the batch: why batching decode pays.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_time.py [--rows 1,2,4,8,16,32,64]
        [--repeats 5] [--threads 1] [--json PATH] [--plot PATH.svg] [--lang en|zh]
    python benchmarks/decode_step_time.py --from-json PATH --plot PATH.zh.svg --lang zh

Times SmolLM2-135M decode steps built directly (no scheduler), one new token for each of
``n`` sequences with contexts uniform in 100-500 (seed 0), exactly as
`benchmarks/roofline.py` builds them. A decode step reads every weight once whatever
``n`` is, so while the weights dominate the step's memory traffic the step barely grows
with ``n`` and the time *per token* falls almost as 1/n: decode is memory-bound. Past the
roofline's ridge (here some 16-32 rows) the arithmetic and each sequence's own keys and
values take over and the step grows with ``n``.

The best of ``--repeats`` steps per size is kept (on a shared machine the slower ones
measure the other processes). ``--json`` writes the times with the date, the machine and
the thread count; ``--plot`` draws step time and time per token against ``n`` from that
data (``--from-json`` redraws without measuring, e.g. the Chinese labels with ``--lang zh``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from roofline import (  # noqa: E402
    as_is,
    decode_contexts,
    empty_kv_caches,
    kv_blocks_for,
    load_smollm2,
    time_step,
)

LABELS = {
    "en": {
        "rows": "rows in the decode step (sequences, one new token each)",
        "step": "step time (ms)",
        "per_token": "time per generated token (ms)",
        "title": "SmolLM2-135M fp32 decode, {machine}, torch threads: {threads}, {date}",
        "step_legend": "one decode step",
        "per_token_legend": "per token (step time / rows)",
    },
    "zh": {
        "rows": "Decode step 的行数（序列数，每个序列 1 个新 token）",
        "step": "一步的时间（ms）",
        "per_token": "每个生成 token 的时间（ms）",
        "title": "SmolLM2-135M fp32 Decode，{machine}，torch 线程数：{threads}，{date}",
        "step_legend": "一个 Decode step",
        "per_token_legend": "每个 token（step 时间 / 行数）",
    },
}


def measure(rows: list[int], repeats: int, attention_backend: str) -> list[dict]:
    """Best and median seconds of a decode step of each size in ``rows``."""
    model = load_smollm2(attention_backend)
    contexts = decode_contexts(max(rows))
    kv_caches = empty_kv_caches(model.config, kv_blocks_for(contexts, spare_blocks=64))
    results = []
    for n in rows:
        (seconds,) = time_step(model, kv_caches, [1] * n, contexts[:n], repeats, [as_is])
        results.append({"rows": n, "best_s": min(seconds), "median_s": statistics.median(seconds)})
        print(f"{n:4d} rows: best {min(seconds) * 1e3:7.1f} ms, "
              f"{min(seconds) * 1e3 / n:6.2f} ms/token", flush=True)  # fmt: skip
    return results


def plot(data: dict, path: str, lang: str) -> None:
    """Step time (left axis) and time per token (right axis) against rows, log-2 x axis;
    an SVG (``path`` ending in .svg) keeps its labels as text."""
    import matplotlib

    matplotlib.use("Agg")
    # In an SVG the text stays text, drawn by the reader's browser in its own fonts: the
    # Chinese labels need no CJK font on the machine that draws the figure.
    matplotlib.rcParams["svg.fonttype"] = "none"
    matplotlib.rcParams["svg.hashsalt"] = "decode_step_time"  # same data, same file
    import matplotlib.pyplot as plt

    text = LABELS[lang]
    rows = [r["rows"] for r in data["results"]]
    step_ms = [r["best_s"] * 1e3 for r in data["results"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(rows, step_ms, "o-", color="C0", label=text["step_legend"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(n) for n in rows])
    ax.set_xlabel(text["rows"])
    ax.set_ylabel(text["step"], color="C0")
    ax.set_ylim(0, max(step_ms) * 1.1)
    per_token = ax.twinx()
    per_token.plot(rows, [t / n for t, n in zip(step_ms, rows)], "s--", color="C3",
                   label=text["per_token_legend"])  # fmt: skip
    per_token.set_ylim(0, max(t / n for t, n in zip(step_ms, rows)) * 1.1)
    per_token.set_ylabel(text["per_token"], color="C3")
    handles = ax.get_legend_handles_labels()[0] + per_token.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center")
    ax.set_title(text["title"].format(**data["machine"]), fontsize=9)
    ax.grid(True, alpha=0.3)
    with warnings.catch_warnings():  # no CJK font needed: the SVG's text is drawn by the browser
        warnings.filterwarnings("ignore", "Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, dpi=120, metadata={"Date": None})
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", help="write the measured times here")
    parser.add_argument("--from-json", help="plot these times instead of measuring")
    parser.add_argument("--plot", help="write the figure (PNG) here")
    parser.add_argument("--lang", choices=sorted(LABELS), default="en")
    args = parser.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
    else:
        torch.set_num_threads(args.threads)
        rows = [int(n) for n in args.rows.split(",")]
        results = measure(rows, args.repeats, args.attention_backend)
        data = {
            "command": "OMP_NUM_THREADS=1 python benchmarks/decode_step_time.py "
            f"--rows {args.rows} --repeats {args.repeats} --threads {args.threads}",
            "machine": {
                "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
                "threads": torch.get_num_threads(),
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "load_average_1min": os.getloadavg()[0],
                "torch": torch.__version__,
            },
            "results": results,
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
    if args.plot:
        plot(data, args.plot, args.lang)


if __name__ == "__main__":
    main()
