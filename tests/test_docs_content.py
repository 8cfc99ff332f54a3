"""The docs' sources, checked without building the site: a figure in every tutorial
chapter, every image they point at exists in the repository, no diagram that needs a
script from the network, and notebook pages without tooling comments."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The English chapters; a translation (NAME.zh.md) follows its chapter's figures.
CHAPTERS = sorted(p for p in (DOCS / "tutorial").glob("*.md") if ".zh." not in p.name)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_tutorial_chapter_has_a_figure(chapter):
    assert IMAGE.search(chapter.read_text()), f"{chapter.name} shows no figure"


@pytest.mark.parametrize("page", sorted(DOCS.glob("**/*.md")), ids=lambda p: p.stem)
def test_images_exist(page):
    for src in IMAGE.findall(page.read_text()):
        if src.startswith("http"):
            pytest.fail(f"{page.name} loads {src} from the network")
        # A snippet is included into pages of docs/: its paths are relative to those.
        base = DOCS if page.parent.name == "snippets" else page.parent
        target = (base / src).resolve()
        assert target.is_file(), f"{page.name}: {src} does not exist"


def test_no_diagram_needs_a_script_from_a_cdn():
    for page in DOCS.glob("**/*.md"):
        assert "```mermaid" not in page.read_text(), f"{page.name}: Mermaid needs mermaid.js"


def test_tool_comments_are_stripped_from_rendered_notebooks():
    sys.path.insert(0, str(ROOT / "notebooks"))
    from execute import strip_tool_comments

    notebook = nbformat.v4.new_notebook()
    code = 'x = 1  # fmt: skip\nimport os  # noqa: E402\ny = 2  # why\nprint("# noqa")'
    notebook.cells = [nbformat.v4.new_code_cell(code), nbformat.v4.new_markdown_cell("a # noqa")]
    strip_tool_comments(notebook)
    assert notebook.cells[0].source == 'x = 1\nimport os\ny = 2  # why\nprint("# noqa")'
    assert notebook.cells[1].source == "a # noqa"
