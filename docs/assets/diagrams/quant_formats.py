"""Draws docs/assets/diagrams/quant_formats.svg: one weight row of 64 weights in each
format minivllm runs (fp32, int8 per channel, GGUF Q4_1, GGUF Q8_0), boxes as wide as
their bytes. Run: python docs/assets/diagrams/quant_formats.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

OUT = Path(__file__).resolve().with_suffix(".svg")
WEIGHTS = 64  # two GGUF blocks

# (label, [(bytes, text, colour), ...]) per format, for one row of 64 weights.
FORMATS = [
    ("fp32 (today's default)", [(4 * WEIGHTS, "64 x fp32 = 256 bytes", "#9ecae1")]),
    (
        "int8: per-channel scale",
        [(4, "scale", "#fdae6b"), (WEIGHTS, "64 x int8", "#a1d99b")],
    ),
    (
        "GGUF Q4_1: two blocks of 32",
        [
            (2, "d", "#fdae6b"),
            (2, "m", "#fd8d3c"),
            (16, "4-bit", "#a1d99b"),
            (2, "d", "#fdae6b"),
            (2, "m", "#fd8d3c"),
            (16, "4-bit", "#a1d99b"),
        ],
    ),  # fmt: skip
    (
        "GGUF Q8_0: two blocks of 32",
        [
            (2, "d", "#fdae6b"),
            (32, "32 x int8", "#a1d99b"),
            (2, "d", "#fdae6b"),
            (32, "32 x int8", "#a1d99b"),
        ],
    ),  # fmt: skip
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for i, (label, boxes) in enumerate(FORMATS):
        y, x = len(FORMATS) - 1 - i, 0
        for size, text, colour in boxes:
            ax.add_patch(Rectangle((x, y), size, 0.7, facecolor=colour, edgecolor="black"))
            if size >= 14:
                ax.text(x + size / 2, y + 0.35, text, ha="center", va="center", fontsize=8)
            x += size
        total = sum(size for size, _, _ in boxes)
        ax.text(-4, y + 0.35, label, ha="right", va="center", fontsize=9)
        ax.text(x + 4, y + 0.35, f"{total} B ({8 * total / WEIGHTS:.2f} bits/weight)",
                va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(-110, 300)
    ax.set_ylim(-0.3, len(FORMATS))
    ax.axis("off")
    ax.set_title("One row of 64 weights, drawn to scale (width = bytes in the file)", fontsize=10)
    fig.tight_layout()
    plt.rcParams["svg.fonttype"] = "none"  # labels stay text
    fig.savefig(OUT, metadata={"Date": None})


if __name__ == "__main__":
    main()
