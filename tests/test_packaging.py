"""kernels/ never shadows Hugging Face's `kernels` package, and still installs as
`minivllm_kernels` with its backends (kernels/README.md says why it has no __init__.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minivllm.attention import get_backend, registry

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ("numba_cpu", "numba_cuda", "random_batch")


def _run_in(cwd: Path, code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter with `cwd` first on sys.path, as pytest and a
    notebook started from the repository root have it; return what it printed."""
    prologue = f"import sys; sys.path.insert(0, {str(cwd)!r})\n"
    result = subprocess.run(
        [sys.executable, "-c", prologue + code],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**_clean_env(), **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_import_kernels_from_the_repository_root_is_not_our_folder() -> None:
    """With the repository root first on sys.path, `import kernels` finds Hugging Face's
    package where it is installed (transformers 5.25+ imports it) and otherwise only a
    namespace package, never kernels/ as a regular package of that name."""
    where = _run_in(ROOT, "import kernels; print(getattr(kernels, '__file__', None))")
    try:
        hf_kernels = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert where == "None"  # a namespace package has no file
    else:
        assert Path(where) == Path(hf_kernels.locate_file("kernels/__init__.py"))


def test_transformers_models_import_from_the_repository_root() -> None:
    """What failed when kernels/ had an __init__.py and transformers 5.25 was installed:
    `from kernels import CUDAProperties, ...` inside transformers' model code."""
    assert _run_in(ROOT, "from transformers import PreTrainedModel; print('ok')") == "ok"


def test_minivllm_kernels_exposes_the_backends_behind_the_entry_points() -> None:
    """The bundled entry points (pyproject.toml, and the registry's copy of them) name
    classes that `minivllm_kernels` provides, and `get_backend` returns those classes."""
    pytest.importorskip("numba")
    for name, target in registry.BUNDLED_ENTRY_POINTS.items():
        module_name, _, class_name = target.partition(":")
        backend_cls = getattr(importlib.import_module(module_name), class_name)
        assert get_backend(name) is backend_cls
        assert backend_cls.name == name


@pytest.mark.slow
def test_wheel_ships_minivllm_kernels_and_its_entry_points(tmp_path: Path) -> None:
    """A plain `pip install .` (a wheel): the kernels land under minivllm_kernels/, no
    top-level `kernels` is installed, and the numba-cpu entry point loads from there."""
    pytest.importorskip("numba")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip("pyproject.toml needs setuptools>=68 to build")
    source = tmp_path / "src"  # a copy, so the build leaves no build/ in the repository
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("minivllm", "kernels"):
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")]
    subprocess.run([*pip, *build, str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("minivllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"minivllm_kernels/{m}.py" for m in KERNEL_MODULES} <= set(names)
    assert not [n for n in names if n.startswith("kernels/")]

    site = tmp_path / "site"
    install = ["install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)]
    subprocess.run([*pip, *install], check=True, capture_output=True)
    code = (
        "from importlib.metadata import distributions\n"
        f"(dist,) = distributions(path=[{str(site)!r}])\n"
        "eps = dist.entry_points.select(group='minivllm.attention_backends')\n"
        "backend = eps['numba-cpu'].load()\n"
        "print(backend.name, backend.__module__, sys.modules[backend.__module__].__file__)\n"
    )
    # Run from an empty folder: only the installed copy can answer.
    (elsewhere := tmp_path / "elsewhere").mkdir()
    name, module, path = _run_in(elsewhere, code, PYTHONPATH=str(site)).split()
    assert (name, module) == ("numba-cpu", "minivllm_kernels.numba_cpu")
    assert Path(path) == site / "minivllm_kernels" / "numba_cpu.py"
