"""What every quantized linear method provides (vLLM's ``LinearMethodBase``).

A `Linear` whose ``quant_method`` is set hands its weights and its matmul to it. The
layer's ``weight`` Parameter is then an empty placeholder that carries
``dequantize_rows``, so that an embedding tied to the LM head still reads its rows
(`minivllm.models.linear.weight_rows`); the real data live in buffers the method
registers on the layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


class LinearMethod:
    """One format's weights and matmul for a `Linear` layer."""

    name = "none"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the layer's loaded fp32 ``weight`` into this format (int8), or accept the
        data a format loader already put there (gguf)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[..., in_features]``."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The fp32 matrix the stored numbers stand for, ``[out, in]`` (tests, reference)."""
        return self.dequantize_rows(layer, torch.arange(layer.out_features))

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the fp32 matrix, ``[*ids.shape, in_features]``."""
        raise NotImplementedError


def set_placeholder_weight(layer: nn.Module, method: LinearMethod) -> None:
    """Replace ``layer.weight`` by an empty Parameter that reads rows through ``method``."""
    placeholder = nn.Parameter(torch.empty(0, device=layer.weight.device), requires_grad=False)
    placeholder.dequantize_rows = functools.partial(method.dequantize_rows, layer)
    layer.weight = placeholder
