"""Name -> attention backend class. Kernels plug in here without the engine knowing them.

The core knows one backend by name, the plain-torch reference. Every other kernel, the
bundled numba ones included, is found through the ``minivllm.attention_backends`` entry
point group, declared in its package's ``pyproject.toml``: the same door a third-party
backend uses (docs/kernels.md, "Writing your own backend").
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

from minivllm.attention.backend import AttentionBackend

ENTRY_POINT_GROUP = "minivllm.attention_backends"

# Imported lazily ("module:Class"), so choosing "torch" never imports numba.
_BUILTIN: dict[str, str] = {"torch": "minivllm.attention.torch_backend:TorchAttentionBackend"}
# The bundled kernels' entry points, exactly as pyproject.toml declares them. Read only when
# the installed metadata lacks them: an editable install made before they were declared
# has no such entry points until `pip install -e .` runs again, and the kernels must not
# disappear meanwhile. (tests/test_attention_registry.py keeps the two lists equal.)
BUNDLED_ENTRY_POINTS: dict[str, str] = {
    "numba-cpu": "minivllm_kernels.numba_cpu:NumbaCpuAttentionBackend",
    "numba-cuda": "minivllm_kernels.numba_cuda:NumbaCudaAttentionBackend",
}
_registered: dict[str, type[AttentionBackend]] = {}


def register_backend(backend_cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make ``backend_cls`` selectable as ``LLM(attention_backend=backend_cls.name)``.

    Usable as a class decorator."""
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
        raise TypeError(f"{backend_cls!r} is not an AttentionBackend subclass")
    _registered[backend_cls.name] = backend_cls
    return backend_cls


def _entry_point_backends() -> dict[str, EntryPoint]:
    installed = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    bundled = {
        name: EntryPoint(name, value, ENTRY_POINT_GROUP)
        for name, value in BUNDLED_ENTRY_POINTS.items()
    }
    return bundled | installed


def available_backends() -> list[str]:
    """Every name `get_backend` accepts."""
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_point_backends()))


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``; ValueError listing the choices otherwise."""
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        module_name, class_name = _BUILTIN[name].split(":")
        backend_cls = getattr(importlib.import_module(module_name), class_name)
    elif name in (plugins := _entry_point_backends()):
        backend_cls = plugins[name].load()
    else:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    return register_backend(backend_cls)
