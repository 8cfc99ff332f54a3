"""The prepacked CPU linear layer computes what F.linear computes, and falls back to it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.models import linear as linear_module
from minivllm.models.linear import Linear, onednn_linear_available

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(torch.empty(1)), reason="this torch build has no oneDNN linear"
)


def make_linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(in_features, out_features, bias=bias)


@needs_onednn
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    in_features=st.integers(1, 96),
    out_features=st.integers(1, 96),
    bias=st.booleans(),
)
def test_prepacked_equals_f_linear(rows, in_features, out_features, bias) -> None:
    layer = make_linear(in_features, out_features, bias)
    layer.process_weights_after_loading()
    assert layer.packed_weight is not None
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        # A strided input (a slice of a wider activation) goes through the same path.
        wide = torch.randn(rows, 2 * in_features)[:, :in_features]
        torch.testing.assert_close(
            layer(wide), F.linear(wide, layer.weight, layer.bias), atol=1e-5, rtol=1e-5
        )


def test_without_onednn_the_layer_is_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda weight: False)
    layer = make_linear(8, 5, bias=True)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_prepack_false_drops_the_packed_copy() -> None:
    layer = make_linear(8, 5, bias=False)
    layer.process_weights_after_loading()
    layer.process_weights_after_loading(prepack=False)
    assert layer.packed_weight is None


def test_half_precision_weights_are_not_packed() -> None:
    layer = make_linear(8, 5, bias=False).to(torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn
def test_loaded_model_is_prepacked(tiny_llama_path) -> None:
    from minivllm.attention import get_backend
    from minivllm.models.loader import load_model

    model, _ = load_model(tiny_llama_path, get_backend("torch")(), torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
