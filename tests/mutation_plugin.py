"""A pytest plugin for `make mutation` only: run the tests that need no model checkpoint.

Mutation testing runs the tests once per mutant, hundreds of times; the tests that load a
tiny checkpoint cost seconds each. The core's behaviour is pinned down by model-free tests
(fake models, hand-built sequences), so the mutation run keeps only those. Enabled with
``-p tests.mutation_plugin`` (pyproject.toml, ``[tool.mutmut]``).

``MUTATION_SKIP="name ..."`` also leaves out the tests whose id contains one of the names:
a first, fast pass (``MUTATION_SKIP=test_scheduler_machine``, the engine's state machine,
about 10 s a run); the survivors are then rerun by name without it (docs/contributing.md).
"""

from __future__ import annotations

import os

# A test needs a checkpoint when one of these is among its fixtures (or theirs).
# byte_model: a small checkpoint on the byte tokenizer (tests/test_structured_outputs.py).
MODEL_FIXTURES = {
    "tiny_model_path", "tiny_llama_path", "smollm2_path", "bigram_llama_path", "byte_model"
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    skip = os.environ.get("MUTATION_SKIP", "").split()
    keep, drop = [], []
    for item in items:
        needs_model = MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        skipped = any(name in item.nodeid for name in skip)
        (drop if needs_model or skipped else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
