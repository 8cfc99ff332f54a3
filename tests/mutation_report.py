"""The mutation score of the last `make mutation` run, and the mutants the tests missed.

    python tests/mutation_report.py [--diffs] [--equivalent]

Reads mutmut's results (``mutants/**/*.py.meta``, written by ``mutmut run``), leaves out
the *equivalent* mutants (edits that change no behaviour anyone can observe, so no test
can kill them: those listed below, and edits of an assert's message text), and prints,
per module, killed / (checked - equivalent), then every surviving mutant (``--diffs``:
with its diff, from ``mutmut show``).

Mutant names are ``module.function__mutmut_N``; the numbers shift when the function's
source changes, so after editing a module re-check its equivalent mutants here (a stale
entry only makes the score stricter: the mutant is then counted as a survivor again).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # a failing test, a timeout, a crash
SURVIVED = {0}
NOT_TESTED = {5, 33}  # no test reaches the function: a survivor too

# name -> why no test can tell the mutant from the original (checked by hand).
EQUIVALENT: dict[str, str] = {
    "minivllm.kv_cache_manager.x_hash_block_tokens__mutmut_8": (
        'array("Q") for array("q"): token ids are never negative (add_request checks), and '
        "a non-negative id has the same 8 bytes signed or unsigned"
    ),
    "minivllm.static_scheduler.x\u01c1StaticBatchScheduler\u01c1__init____mutmut_8": (
        "num_decode_steps starts at None: _start_batch sets it to 0 before anything reads it"
    ),
    "minivllm.static_scheduler.x\u01c1StaticBatchScheduler\u01c1__init____mutmut_9": (
        "num_decode_steps starts at 1: _start_batch sets it to 0 before anything reads it"
    ),
}
ASSERT_MESSAGE = "the text of an assert's message (shown only when an invariant is broken)"
STRING = re.compile(r"""[rbf]*("[^"]*"|'[^']*')""")


def why_equivalent(name: str, diff: str) -> str | None:
    """The reason a mutant changes nothing observable, or None. Besides the hand-checked
    list, one kind is recognised from the diff: a change inside an assert's message."""
    if name in EQUIVALENT:
        return EQUIVALENT[name]
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("- ")]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+ ")]
    if (
        len(removed) == len(added) == 1
        and removed[0].startswith("assert ")
        and STRING.sub('""', removed[0]) == STRING.sub('""', added[0])
    ):
        return ASSERT_MESSAGE
    return None


def show(name: str) -> str:
    return subprocess.run(["mutmut", "show", name], capture_output=True, text=True).stdout


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
    parser.add_argument("--equivalent", action="store_true", help="list the equivalent ones")
    args = parser.parse_args()

    results = load_results()
    if not results:
        raise SystemExit("no mutmut results under mutants/: run `make mutation` first")
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors, equivalent = [], []
    for name, code in sorted(results.items()):
        module = module_of(name)
        if code is None:
            counts[module]["not checked"] += 1
        elif code in KILLED:
            counts[module]["killed"] += 1
        elif reason := why_equivalent(name, show(name)):
            counts[module]["equivalent"] += 1
            equivalent.append((name, reason))
        else:
            counts[module]["survived"] += 1
            survivors.append(name)

    print(f"{'module':32} {'killed':>6} {'survived':>8} {'equivalent':>10} {'unchecked':>9} score")
    total = Counter()
    for module, c in sorted(counts.items()):
        total += c
        print(_row(module, c))
    print(_row("all", total))
    if args.equivalent:
        print(f"\n{len(equivalent)} equivalent mutants, not counted:")
        for name, reason in equivalent:
            print(f"  {name}: {reason}")
    if survivors:
        print(f"\n{len(survivors)} surviving mutants (`mutmut show NAME` for the diff):")
    for name in survivors:
        print(" ", name)
        if args.diffs:
            print("    " + show(name).strip().replace("\n", "\n    "))


def _row(module: str, c: Counter) -> str:
    checked = c["killed"] + c["survived"]
    score = f"{c['killed'] / checked:.1%}" if checked else "-"
    return (
        f"{module:32} {c['killed']:6d} {c['survived']:8d} {c['equivalent']:10d} "
        f"{c['not checked']:9d} {score}"
    )


if __name__ == "__main__":
    main()
