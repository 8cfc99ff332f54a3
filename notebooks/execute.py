"""Execute the tutorial notebooks: to prove they still run, or to re-measure the pinned
copies the docs site shows.

The notebooks' source of truth is the jupytext "percent" files ``notebooks/NN_*.py``
(plain Python, reviewable diffs). This script reads each one and runs it top to bottom in
a fresh Jupyter kernel (working directory: ``notebooks/``), with one CPU thread (the
notebooks seed their workloads themselves). A failing cell stops the script with a
non-zero exit status and the cell's traceback, so ``make test`` fails when a notebook rots.

Where the executed notebook goes:

- by default (``make notebooks``, ``make test``): ``build/notebooks/``, a scratch copy
  that only proves the notebook runs. The site never shows it: a run on a busy machine
  must not replace what the chapters show.
- with ``--pin`` (a maintainer re-measuring, then committing): ``docs/notebooks/NN_*.ipynb``,
  the executed copy the site renders, and each cell tagged ``figure-NAME`` (jupytext:
  ``# %% tags=["figure-NAME"]``) has its first image saved as
  ``docs/assets/figures/NAME.png``, the figure a chapter shows. ``docs/assets/figures/
  provenance.json`` records, per notebook, when, on what machine and with how many
  threads it was measured; the chapters' captions quote it.

    python notebooks/execute.py                 # all notebooks, into build/notebooks/
    python notebooks/execute.py 02              # the ones whose name contains "02"
    python notebooks/execute.py --if-stale      # skip notebooks whose output is newer
    python notebooks/execute.py --pin 03        # re-measure notebook 3 for the site
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent
ROOT = NOTEBOOKS.parent
SCRATCH = ROOT / "build" / "notebooks"  # proof runs (ignored by git)
PINNED = ROOT / "docs" / "notebooks"  # what the site renders (committed)
FIGURES = ROOT / "docs" / "assets" / "figures"  # what the chapters show (committed)
PROVENANCE = FIGURES / "provenance.json"
CELL_TIMEOUT_S = 600
# One thread, as `make demo`: on a CPU shared with other busy processes more threads wait
# on each other at every small op, and a timing then says more about the machine's load
# than about the scheduler. The kernel inherits these.
THREADS = 1
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def sources(patterns: list[str]) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if patterns:
        paths = [p for p in paths if any(pat in p.name for pat in patterns)]
    return paths


def execute(source: Path, out_dir: Path) -> nbformat.NotebookNode:
    notebook = jupytext.read(source)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    strip_tool_comments(notebook)
    nbformat.write(notebook, out_dir / source.with_suffix(".ipynb").name)
    return notebook


# "# fmt: skip", "# noqa: E402": instructions to the formatter and linter of the .py
# sources, noise to a reader of the rendered page.
TOOL_COMMENT = re.compile(r"[ \t]*# (fmt: (skip|off|on)|noqa\b[: A-Z0-9,]*)[ \t]*$", re.M)


def strip_tool_comments(notebook: nbformat.NotebookNode) -> None:
    """Drop the tooling comments from the code cells of the executed notebook."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.source = TOOL_COMMENT.sub("", cell.source)


def save_tagged_figures(notebook: nbformat.NotebookNode, figures_dir: Path) -> list[str]:
    names = []
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
            figures_dir.mkdir(parents=True, exist_ok=True)
            name = tag.removeprefix("figure-")
            (figures_dir / f"{name}.png").write_bytes(base64.b64decode(images[0]))
            names.append(name)
    return names


def machine() -> str:
    """The CPU model and core count, e.g. "AMD EPYC, 2 cores (x86_64)"."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores ({platform.machine()})"


def record_provenance(source: Path, figures: list[str], seconds: float, load: float) -> None:
    """Note in provenance.json when and where the pinned copy of ``source`` was measured."""
    records = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    records[source.stem] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "threads": THREADS,
        # Other processes' load when the run started: a busy machine times slower.
        "load_average": round(load, 1),
        "run_time_s": round(seconds),
        "figures": figures,
        "command": f"python notebooks/execute.py --pin {source.stem[:2]}",
    }
    PROVENANCE.write_text(json.dumps(dict(sorted(records.items())), indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="run only notebooks whose name has one")
    parser.add_argument("--if-stale", action="store_true", help="skip up-to-date outputs")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="write the site's copies (docs/notebooks/, docs/assets/figures/) to commit",
    )
    args = parser.parse_args()
    out_dir = PINNED if args.pin else SCRATCH
    out_dir.mkdir(parents=True, exist_ok=True)
    # Kernels inherit this: tqdm's "IProgress not found" (no ipywidgets) is noise on a page.
    os.environ["PYTHONWARNINGS"] = "ignore:IProgress not found"
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(THREADS)
    paths = sources(args.patterns)
    if not paths:
        print(f"no notebook matches {args.patterns}", file=sys.stderr)
        return 1
    for source in paths:
        target = out_dir / source.with_suffix(".ipynb").name
        if args.if_stale and target.exists() and target.stat().st_mtime > source.stat().st_mtime:
            print(f"{source.name}: up to date")
            continue
        start, load = time.perf_counter(), os.getloadavg()[0]
        try:
            notebook = execute(source, out_dir)
        except CellExecutionError as e:
            print(f"{source.name}: FAILED after {time.perf_counter() - start:.0f} s\n{e}")
            return 1
        seconds = time.perf_counter() - start
        figures = save_tagged_figures(notebook, FIGURES if args.pin else out_dir / "figures")
        if args.pin:
            record_provenance(source, figures, seconds, load)
        print(f"{source.name}: executed in {seconds:.0f} s -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
