"""Draws docs/assets/diagrams/quant_formats.svg (and quant_formats.zh.svg, Chinese
labels): one weight row of 64 weights in each
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


# The Chinese labels (quant_formats.zh.svg).
ZH = {
    "fp32 (today's default)": "fp32（默认）",
    "int8: per-channel scale": "int8：每个输出通道一个 scale",
    "GGUF Q4_1: two blocks of 32": "GGUF Q4_1：两个 32 个权重的块",
    "GGUF Q8_0: two blocks of 32": "GGUF Q8_0：两个 32 个权重的块",
    "64 x fp32 = 256 bytes": "64 x fp32 = 256 字节",
    "{total} B ({bits:.2f} bits/weight)": "{total} 字节（每个权重 {bits:.2f} 位）",
    "One row of 64 weights, drawn to scale (width = bytes in the file)": (
        "一行 64 个权重，按比例画出（宽度 = 文件里的字节数）"
    ),
}


def main() -> None:
    for lang in ("en", "zh"):
        draw(lang)


def draw(lang: str) -> None:
    def say(text: str) -> str:
        return ZH.get(text, text) if lang == "zh" else text

    fig, ax = plt.subplots(figsize=(10, 3.6))
    for i, (label, boxes) in enumerate(FORMATS):
        y, x = len(FORMATS) - 1 - i, 0
        for size, text, colour in boxes:
            ax.add_patch(Rectangle((x, y), size, 0.7, facecolor=colour, edgecolor="black"))
            if size >= 14:
                ax.text(x + size / 2, y + 0.35, say(text), ha="center", va="center", fontsize=8)
            x += size
        total = sum(size for size, _, _ in boxes)
        ax.text(-4, y + 0.35, say(label), ha="right", va="center", fontsize=9)
        note = say("{total} B ({bits:.2f} bits/weight)").format(
            total=total, bits=8 * total / WEIGHTS
        )
        ax.text(x + 4, y + 0.35, note, va="center", fontsize=8)
    ax.set_xlim(-110, 300)
    ax.set_ylim(-0.3, len(FORMATS))
    ax.axis("off")
    ax.set_title(
        say("One row of 64 weights, drawn to scale (width = bytes in the file)"), fontsize=10
    )
    fig.tight_layout()
    plt.rcParams["svg.fonttype"] = "none"  # labels stay text
    fig.savefig(OUT.with_suffix(".zh.svg") if lang == "zh" else OUT, metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    main()
