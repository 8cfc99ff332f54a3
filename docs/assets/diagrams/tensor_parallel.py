"""Draws docs/assets/diagrams/tensor_parallel.svg (and tensor_parallel.zh.svg, Chinese
labels): one decoder layer cut across two tensor-parallel ranks
(docs/tutorial/tensor-parallelism.md).

    python docs/assets/diagrams/tensor_parallel.py

The model drawn has 8 query heads and 2 KV heads (hidden size h, intermediate size I).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small and searchable
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

RANK_X = {0: 2.6, 1: 7.4}  # centre of each rank's column
WIDTH = 4.2
SHARED_COLOR, SHARD_COLOR, COMM_COLOR, CACHE_COLOR = "#eef1f8", "#d6e4ff", "#ffd8a8", "#d3f9d8"

# (y, text per rank, color): the rank's own slice of each step, top to bottom.
ROWS = [
    (11.0, ["hidden [tokens, h]: the same on both ranks"] * 2, SHARED_COLOR),
    (
        9.9,
        ["qkv_proj rows: q heads 0-3, k/v head 0", "qkv_proj rows: q heads 4-7, k/v head 1"],
        SHARD_COLOR,
    ),
    (
        8.8,
        [
            "KV cache: head 0 only\n(same block tables, same slots)",
            "KV cache: head 1 only\n(same block tables, same slots)",
        ],
        CACHE_COLOR,
    ),
    (
        7.7,
        ["attention: q heads 0-3 over k/v head 0", "attention: q heads 4-7 over k/v head 1"],
        SHARD_COLOR,
    ),
    (
        6.6,
        [
            "o_proj columns 0 .. h/2: partial [tokens, h]",
            "o_proj columns h/2 .. h: partial [tokens, h]",
        ],
        SHARD_COLOR,
    ),
    (
        4.6,
        [
            "gate_up_proj rows: gate, up features 0 .. I/2",
            "gate_up_proj rows: gate, up features I/2 .. I",
        ],
        SHARD_COLOR,
    ),
    (
        3.5,
        [
            "down_proj columns 0 .. I/2: partial [tokens, h]",
            "down_proj columns I/2 .. I: partial [tokens, h]",
        ],
        SHARD_COLOR,
    ),
]
ALL_REDUCES = [(5.6, "all-reduce #1: sum the partials (+ residual)"),
               (2.5, "all-reduce #2: sum the partials (+ residual)")]  # fmt: skip


# The Chinese labels (tensor_parallel.zh.svg); code names stay as they are.
ZH = {
    "hidden [tokens, h]: the same on both ranks": "hidden [tokens, h]：两个 rank 上相同",
    "qkv_proj rows: q heads 0-3, k/v head 0": "qkv_proj 的行：q 头 0-3，k/v 头 0",
    "qkv_proj rows: q heads 4-7, k/v head 1": "qkv_proj 的行：q 头 4-7，k/v 头 1",
    "KV cache: head 0 only\n(same block tables, same slots)": "KV Cache：只有头 0\n（块表相同，槽位相同）",  # noqa: E501
    "KV cache: head 1 only\n(same block tables, same slots)": "KV Cache：只有头 1\n（块表相同，槽位相同）",  # noqa: E501
    "attention: q heads 0-3 over k/v head 0": "attention：q 头 0-3 对 k/v 头 0",
    "attention: q heads 4-7 over k/v head 1": "attention：q 头 4-7 对 k/v 头 1",
    "o_proj columns 0 .. h/2: partial [tokens, h]": "o_proj 的列 0 .. h/2：部分和 [tokens, h]",
    "o_proj columns h/2 .. h: partial [tokens, h]": "o_proj 的列 h/2 .. h：部分和 [tokens, h]",
    "gate_up_proj rows: gate, up features 0 .. I/2": "gate_up_proj 的行：gate、up 特征 0 .. I/2",
    "gate_up_proj rows: gate, up features I/2 .. I": "gate_up_proj 的行：gate、up 特征 I/2 .. I",
    "down_proj columns 0 .. I/2: partial [tokens, h]": "down_proj 的列 0 .. I/2：部分和 [tokens, h]",  # noqa: E501
    "down_proj columns I/2 .. I: partial [tokens, h]": "down_proj 的列 I/2 .. I：部分和 [tokens, h]",  # noqa: E501
    "all-reduce #1: sum the partials (+ residual)": "all-reduce #1：部分和相加（+ 残差）",
    "all-reduce #2: sum the partials (+ residual)": "all-reduce #2：部分和相加（+ 残差）",
    "rank {rank} (worker process {rank})": "rank {rank}（worker 进程 {rank}）",
    "column-parallel (no communication)  ->  row-parallel  ->  all-reduce": (
        "列并行（无通信）  ->  行并行  ->  all-reduce"
    ),
}


def box(ax, x, y, w, h, text, color, size=8.5):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                                fc=color, ec="#555", lw=0.8))  # fmt: skip
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def main() -> None:
    for lang in ("en", "zh"):
        draw(lang)


def draw(lang: str) -> None:
    def say(text: str) -> str:
        return ZH[text] if lang == "zh" else text

    fig, ax = plt.subplots(figsize=(9, 8.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(1.6, 12.2)
    ax.axis("off")
    for rank, x in RANK_X.items():
        ax.text(x, 11.9, say("rank {rank} (worker process {rank})").format(rank=rank), ha="center", fontsize=10,  # noqa: E501
                weight="bold")  # fmt: skip
    for y, texts, color in ROWS:
        for rank, x in RANK_X.items():
            box(ax, x, y, WIDTH, 0.75, say(texts[rank]), color)
    for y, text in ALL_REDUCES:
        box(ax, 5, y, 9.2, 0.55, say(text), COMM_COLOR, size=9)
    # Arrows down each column, through the all-reduces.
    stops = sorted([y for y, _, _ in ROWS] + [y for y, _ in ALL_REDUCES], reverse=True)
    for x in RANK_X.values():
        for top, bottom in zip(stops, stops[1:]):
            ax.annotate("", (x, bottom + 0.38), (x, top - 0.38),
                        arrowprops=dict(arrowstyle="->", color="#555", lw=0.8))  # fmt: skip
    ax.text(5, 1.8, say("column-parallel (no communication)  ->  row-parallel  ->  all-reduce"),
            ha="center", fontsize=9, style="italic")  # fmt: skip
    out = Path(__file__).with_suffix(".zh.svg" if lang == "zh" else ".svg")
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
