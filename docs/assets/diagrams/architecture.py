"""Draws docs/assets/diagrams/architecture.svg, the data-flow diagram of docs/architecture.md
(a file, so the page needs no JavaScript and renders offline).

    python docs/assets/diagrams/architecture.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small and searchable
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

# name: (x, y, title, detail); the main path runs down the middle column.
BOXES = {
    "user": (3, 13, "LLM.generate / LLMEngine.add_request", ""),
    "inproc": (3, 12, "InputProcessor", "tokenize, validate"),
    "seq": (3, 11, "Sequence", "token_ids, num_computed_tokens, block_table"),
    "sched": (3, 9.7, "Scheduler.schedule()", "token budget, chunking, preemption"),
    "kvm": (7.6, 9.7, "KVCacheManager", "block tables"),
    "alloc": (7.6, 8.5, "BlockAllocator", "free list, ref counts"),
    "executor": (3, 8.0, "Executor.execute_model()", "model, KV cache; 1 process or TP workers"),
    "runner": (3, 6.9, "ModelRunner.prepare_inputs()", "input_ids, positions, AttentionMetadata"),
    "model": (3, 5.8, "CausalLM (models/llama.py)", "flat [num_tokens, hidden]"),
    "write": (7.6, 6.6, "write_kv_cache", "slot_mapping"),
    "cache": (7.6, 5.5, "kv_caches", "[layers, 2, blocks, block_size, kv_heads, head_dim]"),
    "backend": (7.6, 4.4, "AttentionBackend.forward()", "torch / numba-cpu / numba-cuda"),
    "sampler": (3, 4.4, "Sampler", "greedy, temperature, top-k/p, min-p"),
    "update": (3, 3.1, "Scheduler.update_from_output()", "num_computed_tokens += scheduled"),
    "outproc": (3, 1.9, "OutputProcessor", "append tokens, detokenize, stop checks"),
    "out": (3, 0.8, "RequestOutput", ""),
}
# (from, to, label, both directions)
ARROWS = [
    ("user", "inproc", "", False),
    ("inproc", "seq", "", False),
    ("seq", "sched", "", False),
    ("sched", "kvm", "allocate_slots / free", True),
    ("kvm", "alloc", "", True),
    (
        "sched",
        "executor",
        "SchedulerOutput: chunks of token ids,\nstart position, block table",
        False,
    ),
    ("executor", "runner", "", False),
    ("runner", "model", "", False),
    ("model", "write", "k, v per layer", False),
    ("write", "cache", "", False),
    ("cache", "backend", "", False),
    ("backend", "model", "attention output", False),
    ("model", "sampler", "logits of rows that sample", False),
    ("sampler", "update", "ModelRunnerOutput: sampled_token_ids", False),
    ("update", "outproc", "", False),
    ("outproc", "out", "", False),
]
WIDTH, HEIGHT = 3.6, 0.72


def draw(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 12))
    ax.set_xlim(0.4, 9.6)
    ax.set_ylim(0.2, 13.6)
    ax.axis("off")
    for x, y, title, detail in BOXES.values():
        ax.add_patch(
            FancyBboxPatch(
                (x - WIDTH / 2, y - HEIGHT / 2), WIDTH, HEIGHT,
                boxstyle="round,pad=0.02,rounding_size=0.12", facecolor="#e8ecf7",
                edgecolor="#3f51b5", linewidth=1.2,
            )
        )  # fmt: skip
        ax.text(x, y + (0.12 if detail else 0), title, ha="center", va="center",
                fontsize=10, fontweight="bold", family="monospace")  # fmt: skip
        if detail:
            ax.text(x, y - 0.17, detail, ha="center", va="center", fontsize=8, color="#333")
    for start, end, label, both in ARROWS:
        (x0, y0, *_), (x1, y1, *_) = BOXES[start], BOXES[end]
        dx, dy = x1 - x0, y1 - y0
        # Leave and enter each box at its edge: the side edges between the two columns,
        # top and bottom within a column.
        if dx:
            side = WIDTH / 2 * (1 if dx > 0 else -1)
            x0, x1 = x0 + side, x1 - side
        else:
            edge = HEIGHT / 2 * (1 if dy > 0 else -1)
            y0, y1 = y0 + edge, y1 - edge
        style = "<|-|>" if both else "-|>"
        ax.annotate("", (x1, y1), (x0, y0),
                    arrowprops=dict(arrowstyle=style, color="#3f51b5", lw=1.3))  # fmt: skip
        if label and dx:  # above a sideways arrow
            ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.12, label, fontsize=8, color="#222",
                    va="bottom", ha="center", style="italic")  # fmt: skip
        elif label:  # beside a downward one
            ax.text(x0 + 0.08, (y0 + y1) / 2, label, fontsize=8, color="#222",
                    va="center", ha="left", style="italic")  # fmt: skip
    # finish_requests: the output processor tells the scheduler which requests stopped.
    left, rail = BOXES["sched"][0] - WIDTH / 2, 0.85
    y_from, y_to = BOXES["outproc"][1], BOXES["sched"][1]
    ax.plot([left, rail, rail], [y_from, y_from, y_to], color="#c0392b", lw=1.3)
    ax.annotate("", (left, y_to), (rail, y_to),
                arrowprops=dict(arrowstyle="-|>", color="#c0392b", lw=1.3))  # fmt: skip
    ax.text(rail - 0.1, (y_from + y_to) / 2, "finish_requests", rotation=90, color="#c0392b",
            fontsize=9, ha="right", va="center", style="italic")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(__file__).with_name("architecture.svg"))
