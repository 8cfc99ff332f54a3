"""Small helpers shared by several modules."""

import gc
import importlib
import operator

import numpy as np
import torch

# Booleans whose dtype says so: numpy and torch bool scalars are not ints either.
_BOOL_DTYPES = (np.dtype(bool), torch.bool)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(-a // b)


def as_int(name: str, value) -> int:
    """``value`` as a plain int, if it is one: Python, numpy and torch integers, or a float
    with an integral value (3.0), as vLLM's OpenAI server accepts them. Booleans are
    refused although ``isinstance(True, int)``: ``top_k=True`` is a mistake, not a 1."""
    if isinstance(value, bool) or getattr(value, "dtype", None) in _BOOL_DTYPES:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return operator.index(value)  # what numpy and torch integer scalars support
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def freeze_gc_heap() -> None:
    """Collect garbage once, then move every object alive now (torch, the model, the
    tokenizer: a few hundred thousand) to the collector's permanent generation, as vLLM
    does once its engine is up. Python's full collections scan every tracked object; at
    hundreds of running requests one such pass over the startup objects costs a whole
    GPU step. Call it once per process, where a long-lived engine has just been built
    (a server, a benchmark), not in a library call: frozen objects are never collected.
    Measured in docs/tutorial/what-a-gpu-would-do.md, "The engine's own time per step"."""
    gc.collect()
    gc.freeze()


def resolve_obj_by_qualname(qualname: str):
    """``"package.module.Name"`` -> the object (vLLM's helper of the same name): a feature
    is loaded when it is used, so the core imports none."""
    module_name, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), name)
