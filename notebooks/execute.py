"""Execute the tutorial notebooks and write them, outputs included, where the docs site
reads them.

The notebooks' source of truth is the jupytext "percent" files ``notebooks/NN_*.py``
(plain Python, reviewable diffs). This script reads each one, runs it top to bottom in a
fresh Jupyter kernel (working directory: ``notebooks/``) and saves the executed
``docs/notebooks/NN_*.ipynb``; those are build outputs, ignored by git. A failing cell
stops the script with a non-zero exit status and the cell's traceback, so ``make test``
fails when a notebook rots.

A cell tagged ``figure-NAME`` (jupytext: ``# %% tags=["figure-NAME"]``) also has its
first image saved as ``docs/notebooks/figures/NAME.png``, so that a docs page can show
a figure the notebook just computed: ``![...](../notebooks/figures/NAME.png)``.

    python notebooks/execute.py                 # all notebooks
    python notebooks/execute.py 02              # the ones whose name contains "02"
    python notebooks/execute.py --if-stale      # skip notebooks whose .ipynb is newer
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent
OUT = NOTEBOOKS.parent / "docs" / "notebooks"
FIGURES = OUT / "figures"
CELL_TIMEOUT_S = 600


def sources(patterns: list[str]) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if patterns:
        paths = [p for p in paths if any(pat in p.name for pat in patterns)]
    return paths


def execute(source: Path) -> Path:
    notebook = jupytext.read(source)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    strip_tool_comments(notebook)
    target = OUT / source.with_suffix(".ipynb").name
    nbformat.write(notebook, target)
    save_tagged_figures(notebook)
    return target


# "# fmt: skip", "# noqa: E402": instructions to the formatter and linter of the .py
# sources, noise to a reader of the rendered page.
TOOL_COMMENT = re.compile(r"[ \t]*# (fmt: (skip|off|on)|noqa\b[: A-Z0-9,]*)[ \t]*$", re.M)


def strip_tool_comments(notebook: nbformat.NotebookNode) -> None:
    """Drop the tooling comments from the code cells of the executed notebook."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.source = TOOL_COMMENT.sub("", cell.source)


def save_tagged_figures(notebook: nbformat.NotebookNode) -> None:
    for cell in notebook.cells:
        for tag in cell.metadata.get("tags", []):
            if not tag.startswith("figure-"):
                continue
            images = [
                o.data["image/png"]
                for o in cell.get("outputs", [])
                if "image/png" in o.get("data", {})
            ]
            if not images:
                raise RuntimeError(f"the cell tagged {tag} shows no figure")
            FIGURES.mkdir(parents=True, exist_ok=True)
            png = FIGURES / f"{tag.removeprefix('figure-')}.png"
            png.write_bytes(base64.b64decode(images[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="run only notebooks whose name has one")
    parser.add_argument("--if-stale", action="store_true", help="skip up-to-date outputs")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    # Kernels inherit this: tqdm's "IProgress not found" (no ipywidgets) is noise on a page.
    os.environ["PYTHONWARNINGS"] = "ignore:IProgress not found"
    paths = sources(args.patterns)
    if not paths:
        print(f"no notebook matches {args.patterns}", file=sys.stderr)
        return 1
    for source in paths:
        target = OUT / source.with_suffix(".ipynb").name
        if args.if_stale and target.exists() and target.stat().st_mtime > source.stat().st_mtime:
            print(f"{source.name}: up to date")
            continue
        start = time.perf_counter()
        try:
            execute(source)
        except CellExecutionError as e:
            print(f"{source.name}: FAILED after {time.perf_counter() - start:.0f} s\n{e}")
            return 1
        print(f"{source.name}: executed in {time.perf_counter() - start:.0f} s -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
