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


def test_the_floor_times_each_object_and_adds_them_up_per_request():
    costs = overhead.per_request_floor(repeats=200)
    assert list(costs) == ["chunk", "sampled id", "append + stop check", "RequestOutput"]
    assert all(0 < us < 1000 for us in costs.values())
    table = overhead.floor_table({"a": 1.25, "b": 0.75}, [64, 256]).splitlines()
    assert table[4] == "| all four | 2.00 |"
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in table[-2:]}
    assert rows["| 64"][0] == "0.13" and rows["| 256"][0] == "0.51"  # 64 and 256 x 2 µs
    gpu_ms = {n: float(cells[1]) for n, cells in rows.items()}
    assert gpu_ms["| 256"] > gpu_ms["| 64"] > 3.3  # more requests, more KV read per step


def test_repeats_keep_each_configurations_fastest_run_and_the_json_redraws(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    args = ["--running", "8", "--modes", "decode", "--detokenize", "off", "--steps", "2"]
    args += ["--scheduling", "sync,async", "--repeats", "2", "--json", str(path)]
    assert overhead.main(args) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 ")]
    data = overhead.json.loads(path.read_text())
    assert len(printed) == 2 * 2 + 2  # each run as it ends, then the table of the fastest
    assert [r["async_scheduling"] for r in data["rows"]] == [False, True]
    runs = {False: [], True: []}
    for line in printed[:4]:
        runs[", async" in line].append(float(line.split("|")[-4]))
    for row in data["rows"]:
        assert round(row["cpu_total_ms"], 2) == min(runs[row["async_scheduling"]])
    assert set(data["floor_us"]) == {"chunk", "sampled id", "append + stop check", "RequestOutput"}
    assert overhead.main(["--from-json", str(path), "--plot", str(tmp_path / "busy.svg")]) == 0
    assert "GPU busy" in (tmp_path / "busy.svg").read_text()
