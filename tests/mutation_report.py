"""The mutation score of the last `make mutation` run, and the mutants the tests missed.

    python tests/mutation_report.py [--diffs]

Reads mutmut's results (``mutants/**/*.py.meta``, written by ``mutmut run``), leaves out
the *equivalent* mutants listed below (edits that change no behaviour anyone can observe,
so no test can kill them), and prints, per module, killed / (checked - equivalent), then
every surviving mutant (``--diffs``: with its diff, from ``mutmut show``).

Mutant names are ``module.function__mutmut_N``; the numbers shift when the function's
source changes, so after editing a module re-check its equivalent mutants here (a stale
entry only makes the score stricter: the mutant is then counted as a survivor again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # a failing test, a timeout, a crash
SURVIVED = {0}
NOT_TESTED = {5, 33}  # no test reaches the function: a survivor too

# name -> why no test can tell the mutant from the original.
EQUIVALENT: dict[str, str] = {}


def load_results(root: Path = Path("mutants")) -> dict[str, int | None]:
    results: dict[str, int | None] = {}
    for meta in sorted(root.rglob("*.py.meta")):
        results.update(json.loads(meta.read_text())["exit_code_by_key"])
    return results


def module_of(mutant_name: str) -> str:
    return mutant_name.split(".x\u01c1")[0].rsplit("__mutmut_", 1)[0].rsplit(".x_", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    args = parser.parse_args()

    results = load_results()
    if not results:
        raise SystemExit("no mutmut results under mutants/: run `make mutation` first")
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors = []
    for name, code in sorted(results.items()):
        module = module_of(name)
        if code is None:
            counts[module]["not checked"] += 1
        elif name in EQUIVALENT:
            counts[module]["equivalent"] += 1
        elif code in KILLED:
            counts[module]["killed"] += 1
        else:
            counts[module]["survived"] += 1
            survivors.append(name)

    print(f"{'module':32} {'killed':>6} {'survived':>8} {'equivalent':>10} {'unchecked':>9} score")
    total = Counter()
    for module, c in sorted(counts.items()):
        total += c
        print(_row(module, c))
    print(_row("all", total))
    if survivors:
        print(f"\n{len(survivors)} surviving mutants (`mutmut show NAME` for the diff):")
    for name in survivors:
        print(" ", name)
        if args.diffs:
            diff = subprocess.run(["mutmut", "show", name], capture_output=True, text=True)
            print("    " + diff.stdout.strip().replace("\n", "\n    "))


def _row(module: str, c: Counter) -> str:
    checked = c["killed"] + c["survived"]
    score = f"{c['killed'] / checked:.1%}" if checked else "-"
    return (
        f"{module:32} {c['killed']:6d} {c['survived']:8d} {c['equivalent']:10d} "
        f"{c['not checked']:9d} {score}"
    )


if __name__ == "__main__":
    main()
