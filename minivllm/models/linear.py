"""A linear layer whose weight can be repacked once for the CPU's matrix-multiply library.

Decode multiplies a handful of rows (one per sequence) by every weight matrix. With the
weight in its ordinary row-major layout, torch's CPU GEMM handles such small-M products
poorly: on the 2-core development box a ``[4, 576] x [576, 3072]`` product took 5x as
long as reading the weight once. oneDNN (the library behind ``torch.backends.mkldnn``)
can first reorder the weight into its own blocked layout, which it then streams at close
to memory speed for any number of rows, and at the full matmul speed for prefill.

`process_weights_after_loading` (vLLM's name for this moment) does that reorder once,
after the checkpoint is loaded; it is used only on CPU, in fp32, when this torch build
has the oneDNN ops. Everywhere else, and before it is called, the layer is a plain
``F.linear``. The blocked tensor *replaces* the row-major weight, so the layer holds one
copy: ``weight`` is then a oneDNN tensor (``weight.is_mkldnn``), whose ``to_dense()``
gives back the exact original values. The state dict is written in the ordinary layout,
and ``process_weights_after_loading(prepack=False)`` turns the layer back into a plain
one (do that before changing the weight's values, dtype or device).

A weight shared with another module (small models tie ``lm_head`` to the input embedding)
is the one exception: the embedding still needs the row-major matrix for its lookups, so
the shared parameter stays as it is and the prepacked copy sits beside it
(``packed_beside``), as in vLLM's CPU path.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def onednn_linear_available(weight: torch.Tensor) -> bool:
    """Whether this torch build can prepack ``weight`` for oneDNN's CPU GEMM."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be held in oneDNN's prepacked layout instead."""

    packed_beside: torch.Tensor | None = None  # the prepacked copy of a shared weight

    @property
    def is_prepacked(self) -> bool:
        return self.weight.is_mkldnn or self.packed_beside is not None

    def process_weights_after_loading(self, prepack: bool = True) -> None:
        """Prepack the weight for oneDNN if possible (``prepack=False``: back to row-major)."""
        self._unpack()
        if not (prepack and onednn_linear_available(self.weight)):
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        except RuntimeError:  # a oneDNN build that cannot handle it: keep F.linear
            return
        row_major = weakref.ref(self.weight)
        self.weight = nn.Parameter(packed, requires_grad=False)  # the row-major copy is freed
        shared = row_major()
        if shared is not None:  # ... unless another module holds it too: keep it shared
            self.weight, self.packed_beside = shared, packed

    def _unpack(self) -> None:
        if self.weight.is_mkldnn:
            self.weight = nn.Parameter(self.weight.to_dense())
        self.packed_beside = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.packed_beside is None else self.packed_beside
        if not weight.is_mkldnn:
            return F.linear(x, weight, self.bias)
        if x.dim() != 2:  # oneDNN's op takes rows: flatten the leading dimensions
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """The state dict holds the weight in the ordinary row-major layout."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_mkldnn:
            destination[prefix + "weight"] = self.weight.to_dense()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Loading a state dict into a prepacked layer: unpack, copy, prepack again."""
        prepacked = self.is_prepacked
        self._unpack()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prepacked:
            self.process_weights_after_loading()
