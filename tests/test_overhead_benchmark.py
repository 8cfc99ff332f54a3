"""benchmarks/overhead.py on a few requests: the real engine against the simulated H200
step, its CPU time split into phases that add up to the whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import overhead  # noqa: E402


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_phases_add_up_and_every_running_request_decodes(mode):
    row = overhead.measure(8, mode, tokenizer=None, steps=3, freeze_gc=False)
    assert set(row.cpu_ms) == set(overhead.PHASES)
    assert sum(row.cpu_ms.values()) == pytest.approx(row.cpu_total_ms)
    assert row.cpu_ms["detok"] == 0  # no tokenizer, nothing decoded
    assert row.gpu_ms > 3.3  # at least the weights' read: 16 GB at 4.8 TB/s
    assert 0 < row.busy < 1
    if mode == "decode":  # all 8 in flight decode one token each, every step
        assert row.tokens_per_step == 8
    else:  # finished requests are replaced: their prompts are prefilled in later steps
        assert row.tokens_per_step >= 8


def test_async_scheduling_runs_the_async_path_and_overlaps():
    """The same decodes through the async path: every request still decodes each step, and
    busy counts the CPU's time only where it exceeds the GPU's."""
    row = overhead.measure(8, "decode", tokenizer=None, steps=3, freeze_gc=False,
                           async_scheduling=True)  # fmt: skip
    assert row.tokens_per_step == 8
    assert sum(row.cpu_ms.values()) == pytest.approx(row.cpu_total_ms)
    assert row.busy == pytest.approx(row.gpu_ms / max(row.gpu_ms, row.cpu_total_ms))
    sync = overhead.Row(**{**row.__dict__, "async_scheduling": False})
    assert sync.busy < row.busy


def test_the_stand_in_model_samples_deterministically():
    import torch

    model = overhead.NoComputeModel()
    ids = torch.tensor([5, 1000, 40000])
    tokens = model.compute_logits(ids).argmax(-1)
    assert tokens.tolist() == model.compute_logits(ids).argmax(-1).tolist()
    assert all(overhead.FIRST_TOKEN <= t < overhead.FAKE_VOCAB for t in tokens.tolist())


def test_the_floor_times_each_object_and_scales_with_the_running_count(capsys):
    costs = overhead.per_request_floor(repeats=200)
    assert list(costs) == ["chunk", "sampled id", "append + stop check", "RequestOutput"]
    assert all(0 < us < 1000 for us in costs.values())
    overhead.print_floor([64, 256], repeats=200)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in lines[-2:]}
    assert list(rows) == ["64", "256"]
    floor_ms = {n: float(cells[0]) for n, cells in rows.items()}
    gpu_ms = {n: float(cells[1]) for n, cells in rows.items()}
    assert floor_ms["256"] == pytest.approx(4 * floor_ms["64"], abs=0.02)  # per request
    assert gpu_ms["256"] > gpu_ms["64"] > 3.3  # more requests, more KV read per step
