"""The figures drawn from code stay what the code does today: the mixed-step diagram of
chapter 4 is redrawn from the real ModelRunner and must say what the committed SVGs say,
and the step-time figure of chapter 1 must say what its committed data draws. The SVGs keep
their labels as text, so "say" is their text elements, in order (positions may move with
the matplotlib version)."""

from __future__ import annotations

import importlib.util
import json
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


def _assert_drawn_from_its_data(tmp_path, script: str, data_file: str, figure: str, lang: str):
    """``benchmarks/<script>.py``'s ``plot`` draws the committed SVG (``figure``, or its
    ``.zh.svg`` twin) from the committed data."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    module = _load(ROOT / f"benchmarks/{script}.py")
    results = ROOT / "docs/assets/results"
    data = json.loads((results / data_file).read_text())
    name = figure if lang == "en" else figure.replace(".svg", ".zh.svg")
    module.plot(data, str(tmp_path / name), lang)
    assert _texts(tmp_path / name) == _texts(results / name), (
        f"{name} is not what its data draws: rerun benchmarks/{script}.py --from-json"
    )


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_step_time_figure_is_drawn_from_its_data(tmp_path, lang):
    _assert_drawn_from_its_data(
        tmp_path, "decode_step_time", "decode-step-time-2026-12-03.json",
        "decode-step-time.svg", lang,
    )  # fmt: skip


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_busy_figure_is_drawn_from_its_data(tmp_path, lang):
    _assert_drawn_from_its_data(
        tmp_path, "overhead", "overhead-2026-12-03.json", "overhead-busy.svg", lang
    )
