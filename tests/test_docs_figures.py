"""The figures drawn from code stay what the code does today: the mixed-step diagram of
chapter 4 is redrawn from the real ModelRunner and must say what the committed SVGs say,
and the step-time figure of chapter 1 must say what its committed data draws. The SVGs keep
their labels as text, so "say" is their text elements, in order (positions may move with
the matplotlib version)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = re.compile(r"<text[^>]*>([^<]*)</text>")


def _texts(svg: Path) -> list[str]:
    return TEXT.findall(svg.read_text(encoding="utf-8"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # builds a tiny checkpoint and an engine: ~10 s on 2 shared cores
def test_mixed_step_figure_is_what_the_model_runner_builds(tmp_path):
    diagrams = ROOT / "docs/assets/diagrams"
    mixed_step = _load(diagrams / "mixed_step.py")
    step = mixed_step.capture_mixed_step()
    # What chapter 4 says about the picture, in both languages.
    assert step.positions[:2] == [12, 4] and step.slot_mapping[0] == 16
    assert step.block_tables[0] == [0, 1, 2, 4] and step.cu_seqlens_q == [0, 1, 2, 8]
    for lang, name in (("en", "mixed_step.svg"), ("zh", "mixed_step.zh.svg")):
        mixed_step.draw(step, lang, tmp_path / name)
        assert _texts(tmp_path / name) == _texts(diagrams / name), (
            f"{name} is stale: run python docs/assets/diagrams/mixed_step.py"
        )


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_step_time_figure_is_drawn_from_its_data(tmp_path, lang):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    decode_step_time = _load(ROOT / "benchmarks/decode_step_time.py")
    results = ROOT / "docs/assets/results"
    data = decode_step_time.json.loads((results / "decode-step-time-2026-12-03.json").read_text())
    name = "decode-step-time.svg" if lang == "en" else "decode-step-time.zh.svg"
    decode_step_time.plot(data, str(tmp_path / name), lang)
    assert _texts(tmp_path / name) == _texts(results / name), (
        f"{name} is not what its data draws: rerun benchmarks/decode_step_time.py --from-json"
    )


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_busy_figure_is_drawn_from_its_data(tmp_path, lang):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    overhead = _load(ROOT / "benchmarks/overhead.py")
    results = ROOT / "docs/assets/results"
    data = overhead.json.loads((results / "overhead-2026-12-03.json").read_text())
    name = "overhead-busy.svg" if lang == "en" else "overhead-busy.zh.svg"
    overhead.plot(data, str(tmp_path / name), lang)
    assert _texts(tmp_path / name) == _texts(results / name), (
        f"{name} is not what its data draws: rerun benchmarks/overhead.py --from-json"
    )
