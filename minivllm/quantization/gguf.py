"""``"gguf"``: the bundled GGUF file's own Q4_1 / Q8_0 blocks, never dequantized whole.

The bundled SmolLM2 ships as a llama.cpp GGUF file (minivllm/models/model_files.py): the
attention and MLP matrices as Q4_1, the tied embedding / LM head as Q8_0, the norms as
fp32. The default path dequantizes it all to an fp32 checkpoint once; this one loads the
blocks straight from the file instead (`load_gguf_weights`), so the model holds about a
fifth of the bytes, and multiplies by them with the numba kernel of
``kernels/numba_gguf.py`` (block formats drawn there).

Per shape (`GGUFLinearMethod.apply`): up to `KERNEL_MAX_ROWS` activation rows (decode of
a few sequences) go through the kernel, which reads each weight byte once; more rows
(prefill, big batches) are FLOP-bound, where the kernel loses to a GEMM, so the weight is
dequantized in slices of rows and multiplied by torch's GEMM: the same numbers, a
temporary fp32 copy of one slice at a time.

The file's q and k rows are in llama.cpp's rotary order; they are put back in Hugging
Face's order (what transformers does when it reads a GGUF), which moves whole rows, so
the blocks are untouched.
"""

from __future__ import annotations

import importlib
import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import nn

from minivllm.quantization.base import LinearMethod, set_placeholder_weight

BLOCK = 32
KERNEL_MAX_ROWS = 4  # more activation rows than this: dequantize a slice, then GEMM
DEQUANT_SLICE_ROWS = 2048  # weight rows dequantized at a time on the GEMM path


def kernels():
    """The numba kernels (imported when first used: numba is an optional dependency)."""
    return importlib.import_module("minivllm_kernels.numba_gguf")


class GGUFConfig:
    name = "gguf"

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        return GGUFLinearMethod()


def split_q4_1(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """A Q4_1 matrix as the file stores it (uint8 ``[rows, blocks * 20]``) -> its parts:
    ``qs`` uint8 ``[rows, blocks * 16]``, ``d`` and ``m`` fp32 ``[rows, blocks]``."""
    rows = blocks.shape[0]
    b = np.asarray(blocks).reshape(rows, -1, 20)
    return {
        "qs": np.ascontiguousarray(b[:, :, 4:]).reshape(rows, -1),
        "d": _half(b[:, :, 0:2]),
        "m": _half(b[:, :, 2:4]),
    }


def split_q8_0(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """A Q8_0 matrix (uint8 ``[rows, blocks * 34]``) -> ``qs`` int8 ``[rows, blocks * 32]``
    and ``d`` fp32 ``[rows, blocks]``."""
    rows = blocks.shape[0]
    b = np.asarray(blocks).reshape(rows, -1, 34)
    return {
        "qs": np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(rows, -1),
        "d": _half(b[:, :, 0:2]),
    }


def _half(two_bytes: np.ndarray) -> np.ndarray:
    """fp16 numbers stored as byte pairs -> fp32 (exact: every fp16 is an fp32)."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def dequantize_parts(kind: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """The fp32 weights ``[rows, in_features]`` the parts stand for: ``d * q + m`` (Q4_1)
    or ``d * q`` (Q8_0), exactly the numbers gguf's own dequantize gives."""
    d = parts["d"][:, :, None]
    if kind == "Q8_0":
        q = parts["qs"].reshape(*parts["d"].shape, BLOCK).astype(np.float32)
        return (d * q).reshape(len(d), -1)
    packed = parts["qs"].reshape(*parts["d"].shape, BLOCK // 2)
    q = np.concatenate([packed & 0xF, packed >> 4], axis=2).astype(np.float32)
    return (d * q + parts["m"][:, :, None]).reshape(len(d), -1)


class GGUFLinearMethod(LinearMethod):
    name = "gguf"

    def set_blocks(self, layer: nn.Module, kind: str, parts: dict[str, np.ndarray]) -> None:
        """Give the layer its blocks (``kind``: "Q4_1" or "Q8_0"), as buffers."""
        self.kind = kind
        expected = (layer.out_features, layer.in_features // BLOCK)
        if parts["d"].shape != expected:
            raise ValueError(f"{kind} blocks {parts['d'].shape} do not fit a {expected} layer")
        for name, array in parts.items():
            layer.register_buffer(name, torch.from_numpy(array), persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "qs"):
            raise ValueError("quantization='gguf' loads its blocks from the GGUF file only")
        set_placeholder_weight(layer, self)

    def _parts(self, layer: nn.Module) -> dict[str, np.ndarray]:
        names = ("qs", "d") if self.kind == "Q8_0" else ("qs", "d", "m")
        return {n: getattr(layer, n).numpy() for n in names}

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            out = torch.from_numpy(self.kernel_matmul(layer, rows.numpy()))
        else:  # several rows: GEMMs on dequantized slices of the weight
            out = self.sliced_gemm(layer, rows)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)

    def kernel_matmul(self, layer: nn.Module, x: np.ndarray) -> np.ndarray:
        parts, k = self._parts(layer), kernels()
        threads = torch.get_num_threads()
        if self.kind == "Q8_0":
            return k.q8_0_matmul(parts["qs"], parts["d"], x, threads)
        return k.q4_1_matmul(parts["qs"], parts["d"], parts["m"], x, threads)

    def sliced_gemm(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` by `DEQUANT_SLICE_ROWS` weight rows at a time: each slice dequantized
        by the numba loop into one reused fp32 buffer, then multiplied by torch's GEMM."""
        k, parts = kernels(), self._parts(layer)
        if self.kind == "Q4_1":  # the weights come in nibble order: reorder x to match
            x = torch.from_numpy(np.concatenate(k.split_nibble_inputs(x.numpy())[:2], axis=1))
        out = torch.empty(x.shape[0], layer.out_features)
        buffer = np.empty((min(DEQUANT_SLICE_ROWS, layer.out_features), layer.in_features),
                          dtype=np.float32)  # fmt: skip
        for start in range(0, layer.out_features, DEQUANT_SLICE_ROWS):
            stop = min(start + DEQUANT_SLICE_ROWS, layer.out_features)
            weights = buffer[: stop - start]
            if self.kind == "Q8_0":
                k.q8_0_dequantize(parts["qs"][start:stop], parts["d"][start:stop], weights)
            else:
                k.q4_1_dequantize_nibble_order(
                    parts["qs"][start:stop], parts["d"][start:stop], parts["m"][start:stop],
                    weights,
                )  # fmt: skip
            torch.matmul(x, torch.from_numpy(weights).T, out=out[:, start:stop])
        return out

    def dequantize_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).numpy()
        parts = {name: array[flat] for name, array in self._parts(layer).items()}
        rows = torch.from_numpy(dequantize_parts(self.kind, parts))
        return rows.reshape(*ids.shape, layer.in_features)


# --- loading -------------------------------------------------------------------------


def unpermute_rotary_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows for its rotary layout; put them
    back in Hugging Face's order (transformers does the same to a GGUF's q and k)."""
    rows = array.shape[0]
    per_head = rows // num_heads // 2
    return (
        array.reshape(num_heads, per_head, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
    )


# The file's layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): a header,
# metadata key/value pairs (the tokenizer's 49k strings among them), one entry per tensor
# (name, shape, type, offset), then the tensors' bytes from an aligned start.
# Metadata value types, numbered as in the spec: struct formats of the scalar ones.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
ROWS_PER_READ = 4096  # rows of a tensor read from the file at a time


@dataclass
class GGUFTensorInfo:
    """One tensor of a GGUF file: ``shape`` in numpy order (rows first), ``kind`` the
    ggml type's name ("Q4_1", "Q8_0", "F32"), ``offset`` its first byte in the file."""

    name: str
    shape: tuple[int, ...]
    kind: str
    offset: int
    row_bytes: int


def read_tensor_infos(f: BinaryIO) -> dict[str, GGUFTensorInfo]:
    """The tensor table of an open GGUF file. The metadata values are skipped, not built:
    gguf's ``GGUFReader`` makes a numpy array of each of the tokenizer's ~100k strings,
    about 160 MB of objects for the bundled file, which the engine never reads (its
    tokenizer comes from the converted checkpoint)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def read(fmt: str) -> tuple:
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

    def string() -> str:
        (length,) = read("Q")
        return f.read(length).decode()

    def skip_value(value_type: int, count: int = 1) -> int | None:
        """Skip ``count`` values of a type; return the value when there is one scalar."""
        if value_type == _STRING:
            for _ in range(count):
                f.seek(read("Q")[0], io.SEEK_CUR)
        elif value_type == _ARRAY:
            for _ in range(count):
                item_type, length = read("IQ")
                skip_value(item_type, length)
        elif count == 1:
            return read(_SCALARS[value_type])[0]
        else:
            f.seek(count * struct.calcsize("<" + _SCALARS[value_type]), io.SEEK_CUR)
        return None

    magic, version = read("4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, v{version})")
    tensor_count, kv_count = read("QQ")
    alignment = 32
    for _ in range(kv_count):
        key = string()
        value = skip_value(read("I")[0])
        if key == "general.alignment":
            alignment = value
    entries = []
    for _ in range(tensor_count):
        name = string()
        (n_dims,) = read("I")
        dims = read(f"{n_dims}Q")
        tensor_type, offset = read("IQ")
        ggml_type = GGMLQuantizationType(tensor_type)
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        row_bytes = dims[0] // block * block_bytes  # dims[0]: the length of a row
        entries.append((name, tuple(reversed(dims)), ggml_type.name, offset, row_bytes))
    data_start = -(-f.tell() // alignment) * alignment
    return {
        name: GGUFTensorInfo(name, shape, kind, data_start + offset, row_bytes)
        for name, shape, kind, offset, row_bytes in entries
    }


def read_rows(f: BinaryIO, info: GGUFTensorInfo, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a tensor as the file stores them: uint8 ``[rows, row_bytes]``.
    Read, not memory-mapped: the pages of a mapped file count in the process's resident
    memory for as long as it stays mapped, a second copy of the weights at the peak."""
    raw = np.empty((stop - start, info.row_bytes), dtype=np.uint8)
    f.seek(info.offset + start * info.row_bytes)
    if f.readinto(raw) != raw.nbytes:
        raise ValueError(f"{info.name}: the GGUF file ends inside the tensor")
    return raw


def read_blocks(f: BinaryIO, info: GGUFTensorInfo) -> dict[str, np.ndarray]:
    """A quantized matrix's parts (`split_q4_1`, `split_q8_0`), filled `ROWS_PER_READ`
    rows at a time: the only temporary is one slice of the file's bytes."""
    split = {"Q4_1": split_q4_1, "Q8_0": split_q8_0}[info.kind]
    rows = info.shape[0]
    parts: dict[str, np.ndarray] = {}
    for start in range(0, rows, ROWS_PER_READ):
        stop = min(start + ROWS_PER_READ, rows)
        for name, array in split(read_rows(f, info, start, stop)).items():
            if name not in parts:
                parts[name] = np.empty((rows, array.shape[1]), dtype=array.dtype)
            parts[name][start:stop] = array
    return parts


def load_gguf_weights(model: nn.Module, gguf_path: Path) -> None:
    """Fill ``model`` (a `CausalLM` whose linear layers have GGUF methods) from the file:
    blocks into the linear layers, fp32 norms into the norms. Each tensor is read once
    into its final arrays; no fp32 matrix is made (tests/test_quantization.py bounds the
    memory a load allocates)."""
    with open(gguf_path, "rb") as f:
        _load_gguf_weights(model, gguf_path, f)


def _load_gguf_weights(model: nn.Module, gguf_path: Path, f: BinaryIO) -> None:
    tensors = read_tensor_infos(f)
    config = model.config
    if not config.tie_word_embeddings or "output.weight" in tensors:
        raise ValueError("quantization='gguf' supports the bundled model's tied LM head only")

    def parts(name: str, num_heads: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
        info = tensors.pop(name)
        if info.kind not in ("Q4_1", "Q8_0"):
            raise ValueError(f"{name}: GGUF type {info.kind} is not supported (Q4_1, Q8_0)")
        split = read_blocks(f, info)
        if num_heads is not None:
            split = {k: unpermute_rotary_rows(v, num_heads) for k, v in split.items()}
        return info.kind, split

    def fused(*named: tuple[str, dict[str, np.ndarray]]) -> tuple[str, dict[str, np.ndarray]]:
        kinds = {kind for kind, _ in named}
        if len(kinds) != 1:
            raise ValueError(f"a fused projection mixes GGUF types {sorted(kinds)}")
        first = named[0][1]
        return kinds.pop(), {k: np.concatenate([p[k] for _, p in named]) for k in first}

    def norm(name: str) -> torch.Tensor:
        info = tensors.pop(name)
        if info.kind != "F32":
            raise ValueError(f"{name}: a norm stored as {info.kind}, expected F32")
        raw = read_rows(f, info, 0, 1)  # a vector: one row
        return torch.from_numpy(raw.view(np.float32).reshape(-1))

    def put_linear(layer: nn.Module, kind_parts: tuple[str, dict[str, np.ndarray]]) -> None:
        layer.quant_method.set_blocks(layer, *kind_parts)

    with torch.no_grad():
        put_linear(model.lm_head, parts("token_embd.weight"))
        model.norm.weight.copy_(norm("output_norm.weight"))
        for i, layer in enumerate(model.layers):
            blk = f"blk.{i}."
            attn = layer.self_attn
            put_linear(
                attn.qkv_proj,
                fused(
                    parts(blk + "attn_q.weight", config.num_heads),
                    parts(blk + "attn_k.weight", config.num_kv_heads),
                    parts(blk + "attn_v.weight"),
                ),
            )
            put_linear(attn.o_proj, parts(blk + "attn_output.weight"))
            put_linear(
                layer.mlp.gate_up_proj,
                fused(parts(blk + "ffn_gate.weight"), parts(blk + "ffn_up.weight")),
            )
            put_linear(layer.mlp.down_proj, parts(blk + "ffn_down.weight"))
            layer.input_layernorm.weight.copy_(norm(blk + "attn_norm.weight"))
            layer.post_attention_layernorm.weight.copy_(norm(blk + "ffn_norm.weight"))
    if tensors:
        raise ValueError(
            f"{gguf_path.name} has tensors the model does not use: {list(tensors)[:5]}"
        )
