"""The README's Python examples run as written (on the real SmolLM2 model)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, smollm2_path, capsys):
    exec(compile(EXAMPLES[index], f"README example {index}", "exec"), {})
    assert capsys.readouterr().out.strip()  # every example prints what it generated
