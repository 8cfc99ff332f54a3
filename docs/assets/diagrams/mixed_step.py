"""Draws docs/assets/diagrams/mixed_step.svg (and mixed_step.zh.svg, Chinese labels): one
mixed engine step as the model sees it, the flattened tensors of chapter 4.

    python docs/assets/diagrams/mixed_step.py

The numbers are not typed in: the script runs the real `LLMEngine` and `ModelRunner` on the
tiny random checkpoint of the tests (tests/helpers.py), with pinned prompts, and draws what
`ModelRunner.prepare_inputs` returned for the step where two requests decode and a third
prefills a chunk. ``block_size = 4`` and a budget of 8 tokens keep the picture small:

- step 1: A's 12-token prompt is chunked, 8 tokens;
- step 2: A's last 4 prompt tokens and B's 4-token prompt; both sample a first token;
- step 3 (drawn): A decodes at position 12, B at position 4, and C, which arrived after
  step 2, gets the 6 tokens of budget left: the first chunk of its 10-token prompt.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: the browser draws the Chinese
matplotlib.rcParams["svg.hashsalt"] = "mixed_step"  # the same inputs give the same file
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import make_tiny_checkpoint  # noqa: E402

from minivllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS, BUDGET = 4, 16, 8
PROMPTS = {"A": list(range(10, 22)), "B": list(range(30, 34)), "C": list(range(40, 50))}
COLORS = {"A": "#4e79a7", "B": "#f28e2b", "C": "#59a14f"}
LIGHT = {"A": "#c6d4e6", "B": "#fbd9b6", "C": "#cde4c9"}

TEXT = {
    "en": {
        "title": "One mixed step: A and B decode one token each, C prefills a chunk of its prompt"
        "\n(block_size = 4, max_num_batched_tokens = 8; captured from ModelRunner.prepare_inputs)",
        "per_token": "one entry per token: [num_tokens] = [8]",
        "per_seq": "one entry per sequence: [num_seqs] = [3]",
        "row": "row",
        "sequence": "sequence",
        "decode": "decode",
        "prefill": "prefill chunk",
        "block_tables": "block_tables\n[num_seqs, max_blocks]",
        "padded": "grey: padding, never read",
        "pool": "the KV cache: 16 blocks of 4 slots (dark: written this step, light: K/V "
        "already cached, white: free)",
        "block": "block",
        "samples": "logits only at rows 0 and 1:\nA and B sample; C stops\nmid-prompt: no token",
        "slot": "= block_table[pos // 4] * 4\n   + pos % 4",
    },
    "zh": {
        "title": "一个混合 step：A、B 各 Decode 一个 token，C 对它的 prompt 做一个 Prefill 分块"
        "\n（block_size = 4，max_num_batched_tokens = 8；数据取自 ModelRunner.prepare_inputs）",
        "per_token": "每个 token 一项：[num_tokens] = [8]",
        "per_seq": "每个序列一项：[num_seqs] = [3]",
        "row": "行",
        "sequence": "序列",
        "decode": "Decode",
        "prefill": "Prefill 分块",
        "block_tables": "block_tables\n[num_seqs, max_blocks]",
        "padded": "灰色：填充，不会被读取",
        "pool": "KV Cache：16 个块，每块 4 个槽位"
        "（深色：本步写入，浅色：之前已存的 K/V，白色：空闲）",
        "block": "块",
        "samples": "只有第 0、1 行算 logits：\nA 和 B 采样；C 停在\nprompt 中间，不出 token",
        "slot": "= block_table[pos // 4] * 4\n   + pos % 4",
    },
}


@dataclass
class Step:
    """What `ModelRunner.prepare_inputs` built for one step, as plain lists."""

    seqs: list[str]  # request id of each chunk, in row order
    start_positions: list[int]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # padded with 0, as the runner builds it
    num_blocks_used: list[int]  # real entries per row: ceil(context_len / block_size)


def capture_mixed_step() -> Step:
    """Run the pinned requests on the real engine and keep step 3's inputs."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny")
        engine = LLMEngine(
            EngineConfig(
                model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                max_num_batched_tokens=BUDGET, max_num_seqs=3, attention_backend="torch",
                async_scheduling=False,  # step 3's record holds known tokens, no placeholder
            )
        )  # fmt: skip
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request("A", {"prompt_token_ids": PROMPTS["A"]}, params)
        engine.add_request("B", {"prompt_token_ids": PROMPTS["B"]}, params)
        engine.step()
        engine.step()
        engine.add_request("C", {"prompt_token_ids": PROMPTS["C"]}, params)

        runner = engine.executor.model_runner
        captured = {}
        prepare_inputs = runner.prepare_inputs

        def prepare_inputs_and_keep(scheduler_output):
            captured["chunks"] = [(c.request_id, c.start_position) for c in scheduler_output.chunks]
            captured["inputs"] = prepare_inputs(scheduler_output)
            return captured["inputs"]

        runner.prepare_inputs = prepare_inputs_and_keep
        engine.step()
        runner.prepare_inputs = prepare_inputs

    input_ids, positions, metadata = captured["inputs"]
    seqs, starts = zip(*captured["chunks"])
    context_lens = metadata.context_lens.tolist()
    step = Step(
        seqs=list(seqs),
        start_positions=list(starts),
        input_ids=input_ids.tolist(),
        positions=positions.tolist(),
        slot_mapping=metadata.slot_mapping.tolist(),
        cu_seqlens_q=metadata.cu_seqlens_q.tolist(),
        context_lens=context_lens,
        block_tables=metadata.block_tables.tolist(),
        num_blocks_used=[-(-n // BLOCK_SIZE) for n in context_lens],
    )
    check(step)
    return step


def check(step: Step) -> None:
    """The picture shows what the text says: two decodes then a prefill chunk, and every
    slot is the paged address of its token."""
    assert step.seqs == ["A", "B", "C"], step.seqs
    assert step.cu_seqlens_q == [0, 1, 2, 8], step.cu_seqlens_q
    for i in range(len(step.seqs)):
        table = step.block_tables[i]
        for row in range(step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1]):
            pos = step.positions[row]
            slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            assert step.slot_mapping[row] == slot, (row, slot)


def draw(step: Step, lang: str, path: Path) -> None:
    text = TEXT[lang]
    fig, ax = plt.subplots(figsize=(12, 8.2))
    ax.set_xlim(0, 15.4)
    ax.set_ylim(-0.4, 12.4)
    ax.axis("off")
    ax.text(7.7, 12.0, text["title"], ha="center", va="center", fontsize=11.5)

    def cell(x, y, label, face="white", w=1.0, h=0.6, color="black", size=10, mono=True):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor="#555", linewidth=0.8))
        ax.text(x + w / 2, y + h / 2, str(label), ha="center", va="center", fontsize=size,
                color=color, family="monospace" if mono else None)  # fmt: skip

    def name(y, label, mono=True):
        ax.text(3.1, y + 0.3, label, ha="right", va="center", fontsize=10,
                family="monospace" if mono else None)  # fmt: skip

    # --- per token ----------------------------------------------------------------------
    x0, width = 3.3, 1.1
    seq_of_row = [s for i, s in enumerate(step.seqs) for _ in range(
        step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1])]  # fmt: skip
    ax.text(x0, 11.05, text["per_token"], fontsize=10, style="italic")
    rows = [
        (text["row"], list(range(len(seq_of_row))), False),
        (text["sequence"], seq_of_row, False),
        ("input_ids", step.input_ids, True),
        ("positions", step.positions, True),
        ("slot_mapping", step.slot_mapping, True),
    ]
    for r, (label, values, mono) in enumerate(rows):
        y = 10.2 - r * 0.7
        name(y, label, mono)
        for i, value in enumerate(values):
            owner = seq_of_row[i]
            face = "white" if r == 0 else (COLORS[owner] if r == 1 else LIGHT[owner])
            cell(x0 + i * width, y, value, face, w=width, color="white" if r == 1 else "black")
    # brace-like labels under the rows: which rows are decodes, which the chunk
    for i, seq in enumerate(step.seqs):
        first, last = step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1]
        kind = text["decode"] if last - first == 1 and step.start_positions[i] > 0 else None
        kind = kind or text["prefill"]
        xa, xb = x0 + first * width + 0.05, x0 + last * width - 0.05
        ax.plot([xa, xb], [7.25, 7.25], color=COLORS[seq], linewidth=3)
        ax.text((xa + xb) / 2, 6.95, f"{seq}: {kind}", ha="center", va="center", fontsize=9)
    right = x0 + 8 * width + 0.2
    ax.text(right, 9.1, text["samples"], fontsize=9, va="center")
    ax.text(right, 7.7, text["slot"], fontsize=9, va="center", family="monospace")

    # --- per sequence -------------------------------------------------------------------
    ax.text(x0, 6.25, text["per_seq"], fontsize=10, style="italic")
    name(5.4, "cu_seqlens_q")
    for i, value in enumerate(step.cu_seqlens_q):
        cell(x0 + i * width, 5.4, value, w=width)
    name(4.7, "context_lens")
    for i, value in enumerate(step.context_lens):
        cell(x0 + i * width, 4.7, value, LIGHT[step.seqs[i]], w=width)
    for i, table in enumerate(step.block_tables):
        y = 3.7 - i * 0.6
        for j, block in enumerate(table):
            used = j < step.num_blocks_used[i]
            face = LIGHT[step.seqs[i]] if used else "#e0e0e0"
            cell(x0 + j * width, y, block, face, w=width, color="black" if used else "#888")
        ax.text(x0 - 0.15, y + 0.3, step.seqs[i], ha="right", va="center", fontsize=10)
    ax.text(1.3, 3.1 + 0.3, text["block_tables"], ha="center", va="center", fontsize=10,
            family="monospace")  # fmt: skip
    ax.text(x0 + 4 * width + 0.2, 2.75, text["padded"], fontsize=8.5, va="center", color="#666")

    # --- the pool -----------------------------------------------------------------------
    owner, written, cached = {}, set(step.slot_mapping), set()
    for i, table in enumerate(step.block_tables):
        for block in table[: step.num_blocks_used[i]]:
            owner[block] = step.seqs[i]
        for pos in range(step.start_positions[i]):  # computed in earlier steps
            cached.add(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    ax.text(0.3, 1.95, text["pool"], fontsize=9.5, style="italic")
    slot_w, gap = 0.42, 0.16
    for block in range(NUM_BLOCKS):
        bx = 0.3 + (block % 8) * (BLOCK_SIZE * slot_w + gap)
        by = 0.85 if block < 8 else -0.15
        ax.text(bx + BLOCK_SIZE * slot_w / 2, by + 0.62, f"{text['block']} {block}",
                ha="center", va="bottom", fontsize=8, color="#333")  # fmt: skip
        for offset in range(BLOCK_SIZE):
            slot = block * BLOCK_SIZE + offset
            seq = owner.get(block)
            face = (COLORS[seq] if slot in written else LIGHT[seq] if slot in cached else
                    "white") if seq else "white"  # fmt: skip
            color = "white" if slot in written else "#333"
            cell(bx + offset * slot_w, by, slot, face, w=slot_w, h=0.55, color=color, size=7.5)
    with warnings.catch_warnings():  # no CJK font needed: the SVG's text is drawn by the browser
        warnings.filterwarnings("ignore", "Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    step = capture_mixed_step()
    here = Path(__file__).parent
    draw(step, "en", here / "mixed_step.svg")
    draw(step, "zh", here / "mixed_step.zh.svg")


if __name__ == "__main__":
    main()
