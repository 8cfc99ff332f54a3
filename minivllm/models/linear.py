"""A linear layer whose weight can be repacked once for the CPU's matrix-multiply library.

Decode multiplies a handful of rows (one per sequence) by every weight matrix. With the
weight in its ordinary row-major layout, torch's CPU GEMM handles such small-M products
poorly: on the 2-core development box a ``[4, 576] x [576, 3072]`` product took 5x as
long as reading the weight once. oneDNN (the library behind ``torch.backends.mkldnn``)
can first reorder the weight into its own blocked layout, which it then streams at close
to memory speed for any number of rows, and at the full matmul speed for prefill.

`process_weights_after_loading` (vLLM's name for this moment) makes that copy once,
after the checkpoint is loaded; it is used only on CPU, in fp32, when this torch build
has the oneDNN ops. Everywhere else, and before it is called, the layer is a plain
``F.linear``. The blocked copy is a second copy of the weight (the original stays: it is
what the state dict, tied embeddings and the tests see), so it must be refreshed with
another call if the weight is ever changed after loading.
"""

from __future__ import annotations

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
    """``nn.Linear`` plus an optional oneDNN-prepacked copy of its weight."""

    packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self, prepack: bool = True) -> None:
        """Prepack the weight for oneDNN if possible (``prepack=False``: drop the copy)."""
        self.packed_weight = None
        if prepack and onednn_linear_available(self.weight):
            try:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    self.weight.detach(), None
                )
            except RuntimeError:  # a oneDNN build that cannot handle it: keep F.linear
                self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight is not None and x.dim() == 2
        if not packed or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )
