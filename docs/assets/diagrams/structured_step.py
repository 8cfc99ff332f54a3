"""Draws docs/assets/diagrams/structured_step.svg (and structured_step.zh.svg, Chinese
labels): one engine step with constrained and free requests, and the mask of each row
that samples.

    python docs/assets/diagrams/structured_step.py

Nothing is typed in: the script runs the real `LLMEngine` on SmolLM2-135M-Instruct with
pinned prompts and draws the step's `SchedulerOutput.grammar_bitmask`. The step drawn is
the one where A (free), B (a JSON schema), C (a choice) and E (a regex) decode, and D's
long prompt, just arrived, is chunked: D samples nothing, so it has no row.
Each sampled row's strip is the vocabulary, 49,152 tokens in bins of 256; the darker a
bin, the more of its tokens the row's mask allows. A free row has no mask at all.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: the browser draws the Chinese
matplotlib.rcParams["svg.hashsalt"] = "structured_step"  # the same inputs give the same file
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from minivllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minivllm import StructuredOutputsParams as SO  # noqa: E402
from minivllm.structured_output.backend import unpack_bitmask  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
REQUESTS = {
    "A": ("The capital of France is", None),
    "B": ("Describe a person as JSON:", SO(json=SCHEMA)),
    "C": (
        "Is the sky blue? Answer:",
        SO(choice=["The sky is blue because air scatters blue light the most.", "It is not."]),
    ),
    "D": ("Continuous batching lets a server " * 30, None),
    "E": ("An e-mail address:", SO(regex=r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)")),
}
TEXT = {
    "en": {
        "title": "One step, five requests: a mask only on the rows of constrained requests",
        "free": "free: no mask, row untouched",
        "chunk": "prefill chunk, samples nothing: no row",
        "allows": "mask allows {n:,} of {v:,} tokens",
        "axis": "token id (bins of 256; dark: allowed)",
        "kinds": {
            "A": "A free decode",
            "B": "B JSON schema",
            "C": "C choice",
            "D": "D prompt chunk",
            "E": "E regex",
        },  # fmt: skip
    },
    "zh": {
        "title": "一步里的五个请求：只有受约束请求的行带掩码",
        "free": "不受约束：没有掩码，这一行不动",
        "chunk": "Prefill 分块，不采样：没有行",
        "allows": "掩码允许 {v:,} 个 token 中的 {n:,} 个",
        "axis": "token id（每格 256 个；越深允许的越多）",
        "kinds": {
            "A": "A 自由 Decode",
            "B": "B JSON schema",
            "C": "C 选项",
            "D": "D Prompt 分块",
            "E": "E 正则",
        },  # fmt: skip
    },
}


def capture():
    """Run until the step where B decodes and D is mid-prompt; return its rows."""
    engine = LLMEngine(
        EngineConfig(max_num_batched_tokens=40, async_scheduling=False, enable_prefix_caching=False)
    )
    vocab = engine.model_config.vocab_size
    for name in "ABCE":
        prompt, constraint = REQUESTS[name]
        engine.add_request(name, prompt, SamplingParams(max_tokens=16, temperature=0,
                                                        structured_outputs=constraint))  # fmt: skip
    for _ in range(20):  # until C's and E's grammars are compiled
        if not engine.structured_output.waiting:
            break
        engine.step()
    engine.step()  # everyone has sampled; now D's long prompt arrives
    engine.add_request("D", REQUESTS["D"][0], SamplingParams(max_tokens=16, temperature=0))
    engine.step()
    step = engine.last_step
    sampled = [c.request_id for c in step.chunks if c.sample]
    assert sampled == ["A", "B", "C", "E"] and "D" in step.num_scheduled_tokens, sampled
    mask = step.grammar_bitmask
    allowed = unpack_bitmask(mask.bitmask, vocab).numpy()
    rows = {}
    for index, request_id in enumerate(sampled):
        rows[request_id] = allowed[mask.rows.index(index)] if index in mask.rows else None
    engine.close()
    return rows, step.num_scheduled_tokens, vocab


def draw(rows, scheduled, vocab, lang: str) -> None:
    text = TEXT[lang]
    order = "ABCDE"
    fig, ax = plt.subplots(figsize=(10, 4.2))
    bins = vocab // 256
    for y, name in enumerate(reversed(order)):
        label = f"{text['kinds'][name]} ({scheduled[name]} tok)"
        ax.text(-2, y, label, ha="right", va="center", fontsize=10)
        if name not in rows:
            ax.barh(y, bins, color="#f2f2f2", edgecolor="#bbbbbb", hatch="//")
            ax.text(bins / 2, y, text["chunk"], ha="center", va="center", fontsize=9)
            continue
        allowed = rows[name]
        if allowed is None:
            ax.barh(y, bins, color="#dde6f2", edgecolor="#4e79a7")
            ax.text(bins / 2, y, text["free"], ha="center", va="center", fontsize=9)
            continue
        density = allowed[: bins * 256].reshape(bins, 256).mean(axis=1)
        ax.imshow(density[None, :] ** 0.3, extent=(0, bins, y - 0.4, y + 0.4), aspect="auto",
                  cmap="Oranges", vmin=0, vmax=1)  # fmt: skip
        ax.add_patch(plt.Rectangle((0, y - 0.4), bins, 0.8, fill=False, edgecolor="#e15759"))
        ax.text(bins + 2, y, text["allows"].format(n=int(allowed.sum()), v=vocab), va="center",
                fontsize=9)  # fmt: skip
    ax.set_xlim(-1, bins + 1)
    ax.set_ylim(-0.6, len(order) - 0.4)
    ax.set_yticks([])
    ax.set_xticks(np.linspace(0, bins, 5))
    ax.set_xticklabels([f"{int(x * 256):,}" for x in np.linspace(0, bins, 5)])
    ax.set_xlabel(text["axis"])
    ax.set_title(text["title"], fontsize=11)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    suffix = "" if lang == "en" else ".zh"
    fig.savefig(Path(__file__).with_name(f"structured_step{suffix}.svg"), bbox_inches="tight",
                metadata={"Date": None})  # fmt: skip
    plt.close(fig)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="Glyph")  # the browser draws the Chinese
    captured = capture()
    for language in TEXT:
        draw(*captured, language)
