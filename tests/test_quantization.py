"""Quantized weights (minivllm/quantization/, kernels/numba_gguf.py): each format's matmul
against its dequantize-then-``F.linear`` reference, the GGUF blocks against gguf's own
dequantizer and the fp32 checkpoint, the engine's refusals, the simulator's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minivllm.config import EngineConfig
from minivllm.models import arithmetic
from minivllm.models.linear import Linear, weight_rows
from minivllm.quantization import QUANTIZATION_METHODS, bytes_per_weight, check_quantization
from minivllm.quantization.gguf import (
    GGUFLinearMethod,
    dequantize_parts,
    read_blocks,
    read_tensor_infos,
    split_q4_1,
    split_q8_0,
    unpermute_rotary_rows,
)
from minivllm.quantization.int8 import Int8LinearMethod, quantize_rows
from minivllm.simulator.models import get_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

rows_st = st.integers(1, 64)
seed_st = st.integers(0, 2**31 - 1)


def int8_layer(in_features: int, out_features: int, bias: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    layer.quant_method = Int8LinearMethod()
    layer.process_weights_after_loading()
    return layer


@given(
    num_rows=rows_st,
    in_features=st.integers(1, 80),
    out_features=st.integers(1, 80),
    bias=st.booleans(),
    seed=seed_st,
)
def test_int8_matmul_is_the_dequantized_product_within_activation_rounding(
    num_rows, in_features, out_features, bias, seed
):
    """Every output is the dequantized weight row times the input, up to the rounding of
    the input to int8 (half a quantization step per element, summed over |w|)."""
    layer = int8_layer(in_features, out_features, bias, seed)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(seed + 1))
    weight = layer.quant_method.dequantize(layer)
    reference = F.linear(x, weight, layer.bias)
    out = layer(x)
    assert out.shape == (num_rows, out_features)
    # Activation step: per row max|x| / 127 (int8), or range / 127 with FBGEMM's 7-bit
    # reduced range at one row: at most 2 * max|x| / 127 wide, half of it as error.
    step = 2 * x.abs().amax(dim=1, keepdim=True) / 127
    bound = step / 2 * weight.abs().sum(dim=1) + 1e-4 * (1 + reference.abs())
    assert torch.all((out - reference).abs() <= bound)


@given(in_features=st.integers(1, 80), out_features=st.integers(1, 80), seed=seed_st)
def test_int8_weights_round_to_nearest_per_row(in_features, out_features, seed):
    """q * scale is within half a step of every weight, and each row's largest weight
    is exactly +-127 steps (the scale is the row's own)."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (out_features,)
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q.abs().amax(dim=1) == 127)


def test_int8_zero_rows_stay_zero_and_finite():
    """An all-zero weight row and an all-zero activation row: scale 1, not a division by
    zero (NaN)."""
    layer = Linear(8, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(3, 8))
        layer.weight[1] = 0
    layer.quant_method = Int8LinearMethod()
    layer.process_weights_after_loading()
    x = torch.randn(3, 8)
    x[2] = 0
    for rows in (x, x[2:]):  # several rows (torch._int_mm) and one (FBGEMM)
        out = layer(rows)
        assert torch.isfinite(out).all()
        assert torch.all(out[:, 1] == 0)
    assert torch.all(layer(x)[2] == 0)


def test_int8_batch_rows_are_quantized_alone():
    """Several rows go through per-row activation scales: a row's output does not depend
    on the other rows of its batch."""
    layer = int8_layer(96, 40, True, 0)
    x = torch.randn(5, 96)
    x_loud = x.clone()
    x_loud[0] *= 1000  # a neighbour with huge activations
    assert torch.equal(layer(x)[1:], layer(x_loud)[1:])


# --- GGUF blocks ---------------------------------------------------------------------


def random_blocks(kind: str, rows: int, num_blocks: int, seed: int) -> np.ndarray:
    """A matrix of random, valid GGUF blocks as the file stores them (uint8 bytes)."""
    rng = np.random.default_rng(seed)
    size = 20 if kind == "Q4_1" else 34
    raw = rng.integers(0, 256, (rows, num_blocks, size), dtype=np.uint8)
    scales = (rng.standard_normal((rows, num_blocks, 2)) * 0.05).astype(np.float16)
    if kind == "Q4_1":
        raw[:, :, 0:4] = scales.view(np.uint8)  # d and m
    else:
        raw[:, :, 0:2] = scales[:, :, :1].view(np.uint8)
    return raw.reshape(rows, num_blocks * size)


def gguf_layer(
    kind: str, out_features: int, num_blocks: int, seed: int, bias: bool = False
) -> Linear:
    layer = Linear(32 * num_blocks, out_features, bias=bias)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(
                torch.randn(out_features, generator=torch.Generator().manual_seed(seed))
            )
    layer.quant_method = method = GGUFLinearMethod()
    blocks = random_blocks(kind, out_features, num_blocks, seed)
    method.set_blocks(layer, kind, (split_q4_1 if kind == "Q4_1" else split_q8_0)(blocks))
    layer.process_weights_after_loading()
    layer.raw_blocks = blocks
    return layer


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@given(out_features=st.integers(1, 70), num_blocks=st.integers(1, 7), seed=seed_st)
def test_gguf_parts_dequantize_exactly_as_gguf_does(kind, out_features, num_blocks, seed):
    """Split into parts and rebuilt, the blocks give bit for bit gguf's own fp32 weights
    (what the converted fp32 checkpoint holds)."""
    layer = gguf_layer(kind, out_features, num_blocks, seed)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    expected = gguf.quants.dequantize(layer.raw_blocks, qtype).astype(np.float32)
    assert np.array_equal(layer.quant_method.dequantize(layer).numpy(), expected)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@given(
    num_rows=rows_st,
    out_features=st.integers(1, 70),
    num_blocks=st.integers(1, 7),
    bias=st.booleans(),
    leading=st.sampled_from([(), (2,)]),
    seed=seed_st,
)
def test_gguf_matmul_equals_dequantize_then_linear(
    kind, num_rows, out_features, num_blocks, bias, leading, seed
):
    """The kernel (few rows) and the slice-wise GEMM (many) both compute x @ W.T + b with
    the dequantized W, to fp32 rounding, for inputs with leading dimensions too."""
    layer = gguf_layer(kind, out_features, num_blocks, seed, bias)
    shape = (*leading, num_rows, 32 * num_blocks)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    weight = layer.quant_method.dequantize(layer)
    b = None if layer.bias is None else layer.bias.double()
    reference = F.linear(x.double(), weight.double(), b)
    out = layer(x)
    assert out.shape == (*leading, num_rows, out_features) and out.dtype == torch.float32
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-5
    assert torch.all((out.double() - reference).abs() <= bound)


@given(num_heads=st.integers(1, 6), per_head=st.integers(1, 4), seed=seed_st)
def test_unpermute_rotary_rows_undoes_llama_cpp_permutation(num_heads, per_head, seed):
    """llama.cpp's converter permutes each head's rows (convert_hf_to_gguf.py, `permute`):
    interleaved halves; un-permuting gives back the Hugging Face rows."""
    rows = num_heads * per_head * 2
    hf = np.random.default_rng(seed).standard_normal((rows, 3))
    permuted = hf.reshape(num_heads, 2, per_head, 3).swapaxes(1, 2).reshape(rows, 3)
    assert np.array_equal(unpermute_rotary_rows(permuted, num_heads), hf)


def test_tied_embedding_reads_dequantized_rows():
    layer = gguf_layer("Q8_0", 9, 2, 0)
    ids = torch.tensor([[3, 0], [8, 3]])
    rows = weight_rows(layer.weight, ids)
    assert torch.equal(rows, layer.quant_method.dequantize(layer)[ids])


def test_dequantize_parts_q4_1_nibble_order():
    """Byte i holds weight i (low nibble) and weight i + 16 (high nibble)."""
    parts = {
        "qs": np.array([[0x21] + [0] * 15], dtype=np.uint8),
        "d": np.ones((1, 1), np.float32),
        "m": np.zeros((1, 1), np.float32),
    }
    weights = dequantize_parts("Q4_1", parts)[0]
    assert weights[0] == 1 and weights[16] == 2 and weights[1:16].sum() == 0


# --- refusals and arithmetic -----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "int4"}, "unknown quantization 'int4'"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "computes its activations in float32"),
        ({"quantization": "gguf", "tensor_parallel_size": 2}, "tensor_parallel_size=1"),
        ({"quantization": "gguf", "model": "/nowhere"}, "has none"),
    ],
)
def test_bad_combinations_refused_before_any_work(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_cuda_device_refused():
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.device("cuda"), torch.float32, 1)


@pytest.mark.parametrize("quantization", [None, *QUANTIZATION_METHODS])
def test_weight_bytes_follow_the_format(quantization):
    config = get_model("smollm2-135m")
    fp32 = arithmetic.weight_bytes(config, 4)
    # None is the old count: every parameter the step reads, 4 bytes each.
    read_params = arithmetic.num_parameters(config)
    assert fp32 == 4 * read_params
    fmt = bytes_per_weight(quantization)
    got = arithmetic.weight_bytes(config, 4, quantization=quantization)
    matrices = config.num_layers * arithmetic.layer_matmul_parameters(config)
    vocab = arithmetic.vocab_parameters(config)
    assert got == round(
        matrices * fmt.layer_bytes + vocab * fmt.vocab_bytes + 4 * (read_params - matrices - vocab)
    )


def test_simulated_int8_step_reads_fewer_bytes():
    from minivllm.simulator.cost_model import ChunkShape, step_cost
    from minivllm.simulator.hardware import HARDWARE, get_hardware

    config, hardware = get_model("smollm2-135m"), get_hardware(next(iter(HARDWARE)))
    chunks = [ChunkShape(num_tokens=1, context_len=100, sample=True)]
    fp32 = step_cost(config, hardware, chunks)
    int8 = step_cost(config, hardware, chunks, quantization="int8")
    assert int8.flops == fp32.flops
    saved = fp32.bytes - int8.bytes
    assert saved == (hardware.dtype_bytes - 1) * (
        config.num_layers * arithmetic.layer_matmul_parameters(config)
        + arithmetic.vocab_parameters(config)
    )


# --- the real model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fp32_and_gguf():
    from minivllm.executor import UniProcExecutor

    models = {}
    for quantization in (None, "gguf"):
        config = EngineConfig(quantization=quantization, num_kv_blocks=64)
        models[quantization] = UniProcExecutor(config).model
    return models[None], models["gguf"]


@pytest.mark.slow
def test_gguf_blocks_hold_exactly_the_fp32_checkpoints_weights(smollm2_fp32_and_gguf):
    """The blocks read from the GGUF file (q/k rows un-permuted, q/k/v and gate/up fused)
    stand for bit for bit the matrices of the converted fp32 checkpoint."""
    fp32, quantized = smollm2_fp32_and_gguf
    fp32_linears = {n: m for n, m in fp32.named_modules() if isinstance(m, Linear)}
    checked = 0
    for name, module in quantized.named_modules():
        if isinstance(module, Linear):
            dense = fp32_linears[name].weight.detach()
            dense = dense.to_dense() if dense.is_mkldnn else dense
            assert torch.equal(module.quant_method.dequantize(module), dense), name
            checked += 1
    assert checked == 1 + 4 * fp32.config.num_layers
    for (name, p), (_, q) in zip(fp32.named_parameters(), quantized.named_parameters()):
        if "norm" in name:
            assert torch.equal(p, q), name


@pytest.mark.slow
def test_gguf_greedy_equals_fp32_on_the_parity_prompts():
    """Greedy output of quantization="gguf" against the fp32 path, 24 tokens each: equal,
    or where a token differs, fp32's two best logits there are a near-tie."""
    from minivllm import LLM, SamplingParams
    from tests.test_parity import SMOL_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fp32 = LLM(num_kv_blocks=64)
    expected = fp32.generate(SMOL_PROMPTS, params, use_tqdm=False)
    quantized = LLM(quantization="gguf", num_kv_blocks=64)
    got = quantized.generate(SMOL_PROMPTS, params, use_tqdm=False)
    model = fp32.llm_engine.executor.model
    for want, have in zip(expected, got):
        a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
        if a == b:
            continue
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        gap = _fp32_logit_gap(model, want.prompt_token_ids + list(a[:first]), a[first], b[first])
        print(f"{want.prompt[:30]!r}: token {first} differs, fp32 logit gap {gap:.4f}")
        assert gap < 0.05, (want.prompt, first, gap)


def _fp32_logit_gap(model, token_ids, fp32_choice, gguf_choice) -> float:
    from minivllm import LLM  # noqa: F401  (the model is already loaded)

    logits = _logits_after(model, token_ids)
    return float(logits[fp32_choice] - logits[gguf_choice])


def _logits_after(model, token_ids):
    from minivllm.attention import AttentionMetadata

    n = len(token_ids)
    block_size = 16
    num_blocks = -(-n // block_size)
    cfg = model.config
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_context_len=n,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), kv, metadata)
        return model.compute_logits(hidden[-1:])[0]


# --- the command line ------------------------------------------------------------------


def test_generate_prints_the_format_and_the_weight_bytes(tiny_llama_path, capsys):
    from minivllm.cli import main
    from minivllm.models.loader import load_model_config

    argv = ["generate", "w5 w6", "--model", str(tiny_llama_path), "--num-kv-blocks", "16"]
    assert main([*argv, "--max-tokens", "2", "--quantization", "int8"]) == 0
    err = capsys.readouterr().err
    config, _ = load_model_config(tiny_llama_path)
    read = arithmetic.weight_bytes(config, 4, quantization="int8")
    assert "Weights: quantization int8: int8 per-channel weights" in err
    assert f"{read / 1e6:.1f} MB read per decode step" in err
    assert main([*argv, "--max-tokens", "2"]) == 0
    fp32 = arithmetic.weight_bytes(config, 4)
    assert (
        f"quantization none (fp32): 32-bit floats; {fp32 / 1e6:.1f} MB" in capsys.readouterr().err
    )


def test_an_unknown_format_is_an_argparse_error(capsys):
    from minivllm.cli import main

    assert main(["generate", "w5", "--quantization", "int4"]) == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def _rss_mb(field: str) -> float:
    """A line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@pytest.mark.slow
def test_gguf_load_allocates_little_more_than_the_blocks_it_keeps(monkeypatch):
    """Loading quantization="gguf" allocates the blocks the model keeps and a few MB of
    temporaries: no fp32 matrix, no Python object per metadata string (gguf's reader
    made ~160 MB of them), no memory-mapped copy of the file resident beside the blocks
    (92 MB). Python/numpy allocations by tracemalloc; everything by resident memory."""
    import tracemalloc

    import minivllm.quantization.gguf as gguf_module
    from minivllm.executor import UniProcExecutor

    load, measured = gguf_module.load_gguf_weights, {}

    def measured_load(model, path):
        try:  # reset the peak resident memory to the current one (Linux 4.0+)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            measured["rss_before"] = _rss_mb("VmRSS")
        except OSError:
            pass
        tracemalloc.start()
        try:
            load(model, path)
            measured["traced_peak"] = tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()
        if "rss_before" in measured:
            measured["rss_growth"] = _rss_mb("VmHWM") - measured["rss_before"]

    monkeypatch.setattr(gguf_module, "load_gguf_weights", measured_load)
    model = UniProcExecutor(EngineConfig(quantization="gguf", num_kv_blocks=16)).model
    held = (
        sum(
            getattr(module, name).numel() * getattr(module, name).element_size()
            for module in model.modules()
            if isinstance(module, Linear)
            for name in ("qs", "d", "m")
            if hasattr(module, name)
        )
        / 2**20
    )
    assert held > 100  # Q4_1/Q8_0 blocks of 135M weights; the fp32 LM head alone is 108 MiB
    print(f"blocks {held:.0f} MB, load: {measured}")
    assert measured["traced_peak"] < held + 16
    if "rss_growth" in measured:
        assert measured["rss_growth"] < held + 32


@pytest.mark.slow
def test_gguf_tensor_table_and_blocks_equal_ggufs_own_reader(tmp_path):
    """The loader's own header parser (metadata skipped) finds every tensor of the bundled
    file where gguf's ``GGUFReader`` does, and its row-by-row reads give the same parts;
    a file cut short or not a GGUF is refused by name."""
    from minivllm.models.model_files import find_gguf

    path = find_gguf()
    reader = gguf.GGUFReader(path)
    with open(path, "rb") as f:
        infos = read_tensor_infos(f)
        assert list(infos) == [t.name for t in reader.tensors]
        for tensor in reader.tensors:
            info = infos[tensor.name]
            assert (info.kind, info.offset) == (tensor.tensor_type.name, tensor.data_offset)
            if info.kind == "F32":
                assert info.shape == tuple(tensor.data.shape)
                continue
            split = split_q4_1 if info.kind == "Q4_1" else split_q8_0
            want, got = split(tensor.data), read_blocks(f, info)
            assert want.keys() == got.keys()
            assert all(np.array_equal(want[k], got[k]) for k in want), tensor.name
    last = max((i for i in infos.values() if i.kind != "F32"), key=lambda i: i.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: last.offset + 10])
    with open(cut, "rb") as f, pytest.raises(ValueError, match=last.name):
        read_blocks(f, read_tensor_infos(f)[last.name])
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with open(tmp_path / "not.gguf", "rb") as f, pytest.raises(ValueError, match="GGUF"):
        read_tensor_infos(f)
