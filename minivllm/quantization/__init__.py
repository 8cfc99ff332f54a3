"""Quantized weights behind the `Linear` seam (vLLM's ``QuantizationConfig`` and
``LinearMethodBase``, docs/tutorial/quantization.md).

At one sequence a decode step reads every weight once, so tokens/s is about memory
bandwidth divided by the bytes of weights: fewer bytes per weight, more tokens. A
quantization method is chosen at load (``LLM(quantization="int8")``, ``--quantization``);
every `Linear` of the model then gets the method's `LinearMethod`, which owns that layer's
weights (what is stored, in which layout) and its matmul. ``None``, the default, is the
plain fp32 model, unchanged.

- ``"int8"`` (`minivllm.quantization.int8`): W8A8 dynamic, vLLM's CPU scheme: each weight
  row (output feature) as int8 with one fp32 scale, the activations quantized per row at
  run time; products in int8 with int32 sums (FBGEMM, torch's ``_int_mm``).
- ``"gguf"`` (`minivllm.quantization.gguf`): the bundled GGUF file's own Q4_1 / Q8_0
  blocks, multiplied by the numba kernel in ``kernels/numba_gguf.py``.

The simulator and the start-up lines take bytes per weight from
`minivllm.models.arithmetic.bytes_per_weight`.
"""

from __future__ import annotations

import torch

from minivllm.models.arithmetic import QUANTIZATION_METHODS, WeightFormat, bytes_per_weight


def _unknown(name) -> str:
    return f"unknown quantization {name!r}; choose {', '.join(QUANTIZATION_METHODS)} or None"


def check_quantization(
    quantization: str | None,
    device: torch.device,
    dtype: torch.dtype,
    tensor_parallel_size: int,
) -> None:
    """Refuse, before any work, a format this device, dtype or split cannot run."""
    if quantization is None:
        return
    if not isinstance(quantization, str) or quantization not in QUANTIZATION_METHODS:
        raise ValueError(_unknown(quantization))
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only (its kernels are CPU "
            f"kernels), got device {str(device)!r}"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} computes its activations in float32; "
            f"got dtype {str(dtype).removeprefix('torch.')}"
        )
    if quantization == "int8":
        engines = torch.backends.quantized.supported_engines
        if "fbgemm" not in engines and "x86" not in engines:
            raise ValueError(
                "quantization='int8' needs torch's FBGEMM int8 kernels (an x86 CPU build); "
                f"this torch has {engines}"
            )
    if quantization == "gguf":
        import importlib.util

        if importlib.util.find_spec("numba") is None:
            raise ValueError("quantization='gguf' needs numba: pip install minivllm[kernels]")
        if importlib.util.find_spec("gguf") is None:
            raise ValueError("quantization='gguf' needs gguf: pip install minivllm[gguf]")
        if tensor_parallel_size != 1:
            raise ValueError(
                "quantization='gguf' does not split its blocks across ranks; it needs "
                f"tensor_parallel_size=1, got {tensor_parallel_size}"
            )


def get_quantization_config(quantization: str | None):
    """The method object for a format name (None: no quantization)."""
    if quantization is None:
        return None
    if quantization == "int8":
        from minivllm.quantization.int8 import Int8Config

        return Int8Config()
    if quantization == "gguf":
        from minivllm.quantization.gguf import GGUFConfig

        return GGUFConfig()
    raise ValueError(_unknown(quantization))


def weights_line(quantization: str | None, model_config, dtype_bytes: int = 4) -> str:
    """The start-up line ``serve``, ``bench`` and ``generate`` print: the format and the
    bytes of weights (`minivllm.models.arithmetic.weight_bytes`), held and read per token."""
    from minivllm.models.arithmetic import weight_bytes

    fmt = bytes_per_weight(quantization, dtype_bytes)
    held = weight_bytes(model_config, dtype_bytes, quantization=quantization, with_embedding=True)
    read = weight_bytes(model_config, dtype_bytes, quantization=quantization)
    name = quantization or f"none (fp{8 * dtype_bytes})"
    # int8 keeps two copies of the same numbers: FBGEMM's packed one (one row) and a plain
    # one for torch._int_mm (several rows); a step reads one of them.
    copies = " x 2 copies" if quantization == "int8" else ""
    return (
        f"Weights: quantization {name}: {fmt.description}; {held / 1e6:.1f} MB{copies}, "
        f"{read / 1e6:.1f} MB read per decode step"
    )


__all__ = [
    "QUANTIZATION_METHODS",
    "WeightFormat",
    "bytes_per_weight",
    "check_quantization",
    "get_quantization_config",
    "weights_line",
]
