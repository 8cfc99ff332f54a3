"""The glossary (docs/snippets/glossary-table.md, shown on the English and Chinese glossary
pages) names where each term lives in minivllm's code: every name it gives must exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "snippets" / "glossary-table.md"
SOURCES = [*(ROOT / "minivllm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
CODE = "\n".join(path.read_text(encoding="utf-8") for path in SOURCES)
BUILTINS = {"len"}


def minivllm_cells() -> list[str]:
    rows = [line for line in TABLE.read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    header, _, *body = rows
    column = [cell.strip() for cell in header.strip("|").split("|")].index("minivllm")
    return [[cell.strip() for cell in row.strip("|").split("|")][column] for row in body]


def test_the_glossary_has_a_minivllm_column():
    cells = minivllm_cells()
    assert len(cells) >= 20
    assert sum("`" in cell for cell in cells) >= 18


@pytest.mark.parametrize("cell", minivllm_cells())
def test_every_code_name_in_the_glossary_exists(cell):
    for code in re.findall(r"`([^`]+)`", cell):
        if code.endswith("/"):  # a folder
            assert (ROOT / code).is_dir(), code
            continue
        code = re.sub(r"=\"[^\"]*\"", "", code)  # scheduling_policy="static": the option
        for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code):
            if name not in BUILTINS:
                assert re.search(rf"\b{name}\b", CODE), f"{name} (from `{code}`) not in the code"
