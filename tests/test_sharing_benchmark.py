"""benchmarks/sharing.py on the tiny random model: sharing never costs blocks, saves some
as soon as two sequences share a prompt, and counts exactly what a hand count gives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sharing  # noqa: E402

from minivllm import EngineConfig, LLMEngine  # noqa: E402
from minivllm.bench.workloads import BenchRequest, Workload  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    config = EngineConfig(
        model=str(tiny_llama_path), block_size=4, num_kv_blocks=64, max_model_len=64,
        attention_backend="torch", enable_prefix_caching=False, async_scheduling=False,
    )  # fmt: skip
    return LLMEngine(config)


def test_n_equals_2_by_hand(engine):
    """A 10-token prompt in 4-token blocks: two full blocks and a partial one; 3 output
    tokens each. The last sampled token is never computed, so each sample ends with
    12 computed tokens in 3 blocks. Shared: the 2 full blocks once, plus each sample's own
    third block = 4; separate: 2 x 3 = 6. The second child computes only the 2 tokens past
    the shared blocks: 10 + 2 prefill rows, against 10 + 10."""
    workload = Workload("hand", [BenchRequest("0", list(range(10, 20)), 3)])
    on = sharing.measure(engine, workload, "n", 2, sharing=True)
    off = sharing.measure(engine, workload, "n", 2, sharing=False)
    assert (on.peak_blocks, off.peak_blocks) == (4, 6)
    assert (on.request_peak_blocks, off.request_peak_blocks) == (4, 6)
    assert (on.num_prefill_tokens, off.num_prefill_tokens) == (12, 20)
    assert on.num_output_tokens == off.num_output_tokens == 6
    assert engine.engine_stats.recorded is None  # measure() records nothing
    assert on.num_steps == off.num_steps == 3
    assert engine.kv_cache_manager.num_free_blocks == 64  # everything given back


def test_sharing_never_costs_blocks_and_saves_from_n_2(tiny_llama_path, tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--model", str(tiny_llama_path), "--lengths", "alpaca", "--modes", "n"]
    argv += ["--widths", "1,2,4", "--num-prompts", "2", "--block-size", "4"]
    sharing.main(argv + ["--budget-blocks", "100", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["width"] for r in rows] == [1, 2, 4]
    for r in rows:
        on, off = r["on"], r["off"]
        assert on["num_output_tokens"] == off["num_output_tokens"]  # the same work
        assert on["mean_blocks"] <= off["mean_blocks"] and on["peak_blocks"] <= off["peak_blocks"]
        assert r["batch_on"] >= r["batch_off"] == int(100 // off["request_peak_blocks"])
        if r["width"] == 1:  # one sample shares with nobody
            assert on == {**off, "cpu_s": on["cpu_s"]} and r["saved_mean"] == 0
        else:
            assert r["saved_mean"] > 0 and on["num_prefill_tokens"] < off["num_prefill_tokens"]
    assert rows[2]["saved_mean"] > rows[1]["saved_mean"]  # more samples, more shared
    table = capsys.readouterr().out
    assert "| alpaca | n samples | 4 |" in table


def test_beams_share_and_a_copying_fork_holds_a_copy_per_beam(tiny_llama_path):
    """Off, every beam holds its own copy of every block: at the end ``k`` beams of 12
    computed tokens (10 prompt + 3 output - 1), 3 blocks each. On, they share at least the
    2 full prompt blocks, so never use more."""
    workload = Workload("hand", [BenchRequest("0", list(range(10, 20)), 3)])
    options = dict(model=str(tiny_llama_path), block_size=4, num_kv_blocks=64, max_model_len=64,
                   attention_backend="torch", enable_prefix_caching=False,
                   async_scheduling=False)  # fmt: skip
    for width in (2, 3):
        on = sharing.measure(LLMEngine(EngineConfig(**options)), workload, "beam", width, True)
        off_engine = LLMEngine(EngineConfig(**options, share_forked_blocks=False))
        off = sharing.measure(off_engine, workload, "beam", width, False)
        assert off.peak_blocks == off.request_peak_blocks == 3 * width
        assert on.peak_blocks <= 2 + width and on.mean_blocks < off.mean_blocks
        # Both compute the prompt once: a copying fork copies blocks, it does not recompute.
        assert on.num_prefill_tokens == off.num_prefill_tokens == 10
