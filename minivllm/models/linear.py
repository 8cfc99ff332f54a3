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

A weight tied to the input embedding (small models reuse it as ``lm_head``) is held once
too: the embedding reads its rows out of the prepacked buffer in place (`packed_rows`).
oneDNN's layout for a linear weight keeps the rows in blocks (64 rows side by side,
feature after feature, on AVX2 and AVX-512), so row ``i`` is a strided view into it. The
dense matrix would cost a second copy (113 MB for SmolLM2), and multiplying by it instead
of the prepacked one would make SmolLM2's ``lm_head`` 2x slower at one sequence and 3x at
32. Where the rows cannot be read in place (a layout not seen here, a torch without
``torch.ops.mkldnn.data_ptr``), the tied weight stays a plain matrix for both.
"""

from __future__ import annotations

import ctypes

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
    """``nn.Linear`` whose weight may be held in oneDNN's prepacked layout instead, or,
    with a ``quant_method`` (`minivllm.quantization`), in a quantized format that the
    method owns, matmul included."""

    tied = False  # the input embedding reads this weight's rows (CausalLM.tie_weights)
    quant_method = None  # a quantization LinearMethod, set by the loader before loading
    quantized = False  # the method has processed the weights

    @property
    def is_prepacked(self) -> bool:
        return self.weight.is_mkldnn

    def process_weights_after_loading(self, prepack: bool = True) -> None:
        """Prepack the weight for oneDNN if possible (``prepack=False``: back to row-major).
        A quantized layer hands its weight to its method, once."""
        if self.quant_method is not None:
            if not self.quantized:
                self.quant_method.process_weights_after_loading(self)
                self.quantized = True
            return
        if prepack and self.is_prepacked:
            return  # once is enough (the loader prepacks a tied weight early)
        self._unpack()
        if not (prepack and onednn_linear_available(self.weight)):
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        except RuntimeError:  # a oneDNN build that cannot handle it: keep F.linear
            return
        rows = packed_rows(packed, self.weight.detach()) if self.tied else None
        if self.tied and rows is None:  # the embedding could not read it: keep one plain copy
            return
        self.weight = nn.Parameter(packed, requires_grad=False)  # the row-major copy is freed
        if rows is not None:  # for the embedding (a Parameter attribute, as vLLM's weight_loader)
            self.weight.packed_rows = rows

    def _unpack(self) -> None:
        if self.weight.is_mkldnn:
            self.weight = nn.Parameter(self.weight.to_dense())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return self.quant_method.apply(self, x)
        if not self.weight.is_mkldnn:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # oneDNN's op takes rows: flatten the leading dimensions
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.weight, self.bias, "none", [], ""
        )

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


def packed_rows(packed: torch.Tensor, dense: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``packed`` (``dense`` prepacked), read in place: oneDNN's buffer as a
    ``[row_blocks, block, in_features]`` view in which row ``i`` is ``[i // block, i % block]``;
    None where the buffer is laid out otherwise, or this torch cannot expose it.

    oneDNN lays a linear weight out as blocks of ``block`` rows, each block feature after
    feature with its rows side by side (64 on AVX2 and AVX-512; 1, the row-major matrix,
    or all rows, the transposed one, on older CPUs), the features perhaps padded. Which
    block it chose is not exposed, so each is tried against ``dense``, every row."""
    if not hasattr(torch.ops.mkldnn, "data_ptr"):
        return None
    num_rows, num_features = dense.shape
    nbytes = torch.ops.mkldnn._nbytes(packed)
    buffer = (ctypes.c_byte * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed  # the view keeps the buffer, and so oneDNN's tensor, alive
    flat = torch.frombuffer(buffer, dtype=dense.dtype)
    for block in dict.fromkeys((64, 32, 16, 8, 1, num_rows)):
        num_blocks = -(-num_rows // block)
        padded_features = flat.numel() // (num_blocks * block)
        if padded_features < num_features:
            continue
        shape, strides = (num_blocks, block, num_features), (padded_features * block, 1, block)
        view = flat.as_strided(shape, strides)
        if all(
            torch.equal(_rows_of(view, ids), dense[ids])
            for ids in torch.arange(num_rows).split(512)
        ):
            return view
    return None


def weight_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a weight matrix, ``[*ids.shape, in_features]``: an embedding lookup,
    from the row-major matrix, in place from a prepacked one that has `packed_rows`, or
    dequantized from a quantized layer's blocks (its placeholder's ``dequantize_rows``)."""
    dequantize_rows = getattr(weight, "dequantize_rows", None)
    if dequantize_rows is not None:
        return dequantize_rows(ids)
    if not weight.is_mkldnn:
        return F.embedding(ids, weight)
    return _rows_of(weight.packed_rows, ids)


def _rows_of(row_blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    block = row_blocks.shape[1]
    return row_blocks[ids // block, ids % block]
