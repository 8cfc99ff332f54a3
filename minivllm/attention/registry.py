"""Name -> attention backend class. Kernels plug in here without the engine knowing them."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from minivllm.attention.backend import AttentionBackend

ENTRY_POINT_GROUP = "minivllm.attention_backends"

# Built-ins are imported lazily ("module:Class"), so choosing "torch" never imports numba.
_BUILTIN: dict[str, str] = {
    "torch": "minivllm.attention.torch_backend:TorchAttentionBackend",
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


def _entry_point_backends() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


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
