"""``"int8"``: W8A8 dynamic quantization, vLLM's scheme for CPUs.

Weights: each row (output feature) ``w`` is stored as int8 ``round(w / s)`` with one fp32
scale ``s = max|w| / 127``, a quarter of fp32's bytes. Activations: quantized at run time,
every row (token) with its own scale, so that one sequence's numbers never depend on the
others in its batch; the products are summed in int32 and scaled back to fp32 once.

Two libraries compute it, chosen per shape (`Int8LinearMethod.apply`), both on the same
int8 weights:

- **one row** (a single decoding sequence): FBGEMM's dynamic int8 linear
  (``torch.ops.quantized.linear_dynamic``), which quantizes the activation with one scale
  per call, which for one row is per row. It reads its own packed copy of the weight
  near memory speed: measured 3.9x faster than oneDNN's fp32 on SmolLM2's LM head.
- **several rows** (batches, prefill): per-row int8 activations times the weight through
  ``torch._int_mm`` (int8 x int8 -> int32), then both scales. FBGEMM's call would share
  one activation scale across the rows, which would make a sequence's output depend on
  its neighbours in the batch.

Between the two paths the activation rounding differs (FBGEMM uses a 7-bit unsigned range
with a zero point), so one sequence alone and the same sequence in a batch agree to the
quantization error, not bit for bit.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from minivllm.quantization.base import LinearMethod, set_placeholder_weight


class Int8Config:
    name = "int8"

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return Int8LinearMethod()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and the fp32 scale of each row: ``weight ~= q * scale[:, None]``."""
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.float()


class Int8LinearMethod(LinearMethod):
    name = "int8"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.detach()
        if weight.is_mkldnn:
            weight = weight.to_dense()
        q, scale = quantize_rows(weight.float())
        layer.register_buffer("qweight", q)  # [out, in] int8
        layer.register_buffer("weight_scale", scale)  # [out] fp32
        # FBGEMM's packed copy of the same numbers, for the one-row path.
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated
            warnings.simplefilter("ignore")
            per_channel = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
            )
            bias = None if layer.bias is None else layer.bias.detach().float()
            layer.packed_weight = torch.ops.quantized.linear_prepack(per_channel, bias)
        set_placeholder_weight(layer, self)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            out = torch.ops.quantized.linear_dynamic(rows, layer.packed_weight, True)
        else:
            out = int8_matmul(rows, layer.qweight, layer.weight_scale)
            if layer.bias is not None:
                out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.qweight[ids].float() * layer.weight_scale[ids, None]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``x ~= q * scale[:, None]``."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).to(torch.int8), scale


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor):
    """``x @ (qweight * weight_scale).T`` with ``x`` quantized per row: int8 products
    summed in int32 (``torch._int_mm``), then the two scales."""
    qx, x_scale = quantize_activations(x.float())
    if qx.shape[1] == 1:
        # torch 2.13's CPU _int_mm reads garbage for an inner dimension of 1 (found by
        # tests/test_quantization.py); one product per output is exact in fp32 anyway.
        products = qx.float() @ qweight.float().t()
    else:
        products = torch._int_mm(qx, qweight.t()).float()
    return products * x_scale * weight_scale
