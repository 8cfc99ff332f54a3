"""benchmarks/scheduler_queues.py and benchmarks/token_budget.py on the tiny random model:
the queue table in the docs is exactly what the scheduler does, and the token-budget sweep
writes one row per budget and its figure."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scheduler_queues  # noqa: E402
import token_budget  # noqa: E402

from minivllm import EngineConfig, LLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def queue_rows(tiny_llama_path):
    config = EngineConfig(
        model=str(tiny_llama_path),
        num_kv_blocks=6,
        max_num_batched_tokens=32,
        max_num_seqs=3,
        max_model_len=96,
        attention_backend="torch",
        enable_prefix_caching=False,  # as benchmarks/scheduler_queues.py: a real recompute
        async_scheduling=False,  # as there: the queues after each step, step by step
    )
    return scheduler_queues.trace(LLMEngine(config), 16)


def test_docs_queue_table_is_what_the_scheduler_does(queue_rows):
    """EOS is ignored and prefix caching is off, so the schedule does not depend on the
    model's weights: the tiny model must reproduce the chapter's table row for row (the
    table is a snippet both languages of the chapter include)."""
    chapter = (ROOT / "docs/tutorial/scheduler-queues.md").read_text()
    assert '--8<-- "scheduler-queues-steps.md"' in chapter
    table = (ROOT / "docs/snippets/scheduler-queues-steps.md").read_text()
    documented = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    produced = scheduler_queues.markdown(queue_rows, 32).splitlines()[2:]
    assert produced == documented


def test_queue_trace_invariants(queue_rows):
    for row in queue_rows:
        assert row.budget_spent <= 32 and len(row.running) <= 3
        assert row.blocks_in_use <= 6
    preempted = [row.step for row in queue_rows if row.preempted]
    assert preempted == [7] and queue_rows[7].waiting[0] == "C*"
    # Readmitted first, recomputing its 12 prompt tokens and the 5 it had generated.
    assert queue_rows[9].scheduled["C"] == 17


def test_token_budget_sweep_writes_rows_and_figure(tiny_llama_path, tmp_path, capsys):
    json_path, png = tmp_path / "tb.json", tmp_path / "tb.png"
    argv = ["--model", str(tiny_llama_path), "--budgets", "8,64", "--num-prompts", "3"]
    argv += ["--prompt-len", "uniform:20:40", "--output-len", "3", "--num-kv-blocks", "64"]
    token_budget.main(argv + ["--no-progress", "--json", str(json_path), "--plot-file", str(png)])
    rows = json.loads(json_path.read_text())
    assert [r["max_num_batched_tokens"] for r in rows] == [8, 64]
    for row in rows:
        for name in ("ttft", "prefill", "tpot", "itl"):
            assert 0 < row[name]["p50"] <= row[name]["p99"]
    assert png.stat().st_size > 10_000
    assert "ITL P99" in capsys.readouterr().out
