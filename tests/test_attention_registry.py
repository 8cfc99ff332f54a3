"""Backends are found by name: built-ins lazily, third-party ones through entry points."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minivllm.attention import AttentionBackend, available_backends, get_backend, registry


def test_builtin_backends_are_listed_and_named_as_registered() -> None:
    assert {"torch", "numba-cpu", "numba-cuda"} <= set(available_backends())
    for name in ("torch", "numba-cpu", "numba-cuda"):
        backend_cls = get_backend(name)
        assert issubclass(backend_cls, AttentionBackend)
        assert backend_cls.name == name


def test_bundled_kernels_are_declared_as_entry_points_not_named_by_the_core() -> None:
    """numba-cpu and numba-cuda come through the entry-point group a third-party backend
    uses; the registry's fallback (for an install made before they were declared) is
    the same list as pyproject.toml's."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    assert declared == registry.BUNDLED_ENTRY_POINTS
    assert set(registry._BUILTIN) == {"torch"}


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*numba-cpu"):
        get_backend("flash")


def test_choosing_torch_does_not_import_numba() -> None:
    code = "import sys; from minivllm.attention import get_backend; get_backend('torch'); "
    code += "assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["numba-cpu", "numba-cuda"])
def test_missing_numba_says_how_to_install_it(monkeypatch, name: str) -> None:
    module_name = registry.BUNDLED_ENTRY_POINTS[name].split(":")[0]
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now fails
    with pytest.raises(ImportError, match=r"pip install minivllm\[kernels\]"):
        get_backend(name)


TOY_BACKEND = '''
import torch
from minivllm.attention import AttentionBackend


class ToyBackend(AttentionBackend):
    """Returns the query unchanged: enough to prove it was found and called."""

    name = "toy"
    supported_dtypes = (torch.float32,)
    supported_devices = ("cpu",)

    def forward(self, query, key_cache, value_cache, metadata, scale):
        return query
'''


def test_third_party_backend_registers_through_an_entry_point(tmp_path, monkeypatch) -> None:
    """What `pip install` of a package declaring
    ``[project.entry-points."minivllm.attention_backends"] toy = "toy_backend:ToyBackend"``
    leaves on sys.path: the module and a dist-info folder with entry_points.txt."""
    (tmp_path / "toy_backend.py").write_text(TOY_BACKEND)
    dist_info = tmp_path / "toy_backend-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(f"""
        [{registry.ENTRY_POINT_GROUP}]
        toy = toy_backend:ToyBackend
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.delitem(sys.modules, "toy_backend", raising=False)

    assert "toy" in available_backends()
    backend_cls = get_backend("toy")
    assert backend_cls.__module__ == "toy_backend" and backend_cls.name == "toy"
    assert get_backend("toy") is backend_cls  # loaded once, then registered


def test_backend_without_entry_point_is_unknown(monkeypatch) -> None:
    """The entry-point test above is not passing by accident: no dist-info, no backend."""
    monkeypatch.setattr(registry, "_registered", {})
    assert "toy" not in available_backends()
