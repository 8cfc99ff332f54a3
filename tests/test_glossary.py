"""The glossary (docs/snippets/glossary-table.md, shown on the English and Chinese glossary
pages) names where each term lives in minivllm's code: every name it gives must exist."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import minivllm

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "snippets" / "glossary-table.md"
SOURCES = [*(ROOT / "minivllm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
CODE = "\n".join(path.read_text(encoding="utf-8") for path in SOURCES)
BUILTINS = {"len"}


def minivllm_cells() -> list[str]:
    lines = TABLE.read_text(encoding="utf-8").splitlines()
    header, _, *body = [line for line in lines if line.startswith("|")]
    column = [cell.strip() for cell in header.strip("|").split("|")].index("minivllm")
    return [[cell.strip() for cell in row.strip("|").split("|")][column] for row in body]


def minivllm_class(name: str) -> type | None:
    for module_info in pkgutil.walk_packages(minivllm.__path__, "minivllm."):
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # a module of an optional extra that is not installed
            continue
        found = getattr(module, name, None)
        if inspect.isclass(found):
            return found
    return None


def has_member(cls: type, name: str) -> bool:
    """A method, property or class attribute, a dataclass field, or set in a method."""
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    return re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(cls)) is not None


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
        for dotted in re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", code):
            owner, _, member = dotted.rpartition(".")
            if owner:  # Class.member: the class exists and has that member
                cls = minivllm_class(owner)
                assert cls is not None, f"no class {owner} in minivllm (from `{code}`)"
                assert has_member(cls, member), f"{owner} has no {member} (from `{code}`)"
            elif dotted not in BUILTINS:
                assert re.search(rf"\b{dotted}\b", CODE), f"{dotted} (from `{code}`) not in code"
