"""Attention backends, found by name.

Built-in backends register here; third-party ones register through the
``minivllm.attention_backends`` entry point group (see docs/kernels.md)."""

from __future__ import annotations

from minivllm.attention.backend import AttentionBackend, AttentionMetadata, write_kv_cache
from minivllm.attention.registry import available_backends, get_backend, register_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_backends",
    "get_backend",
    "register_backend",
    "write_kv_cache",
]
