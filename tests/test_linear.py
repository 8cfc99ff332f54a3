"""The prepacked CPU linear layer computes what F.linear computes, and falls back to it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.models import linear as linear_module
from minivllm.models.linear import Linear, onednn_linear_available, weight_rows

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
    weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.is_prepacked
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        expected = F.linear(x, weight, layer.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        # A strided input (a slice of a wider activation) goes through the same path.
        wide = torch.randn(rows, 2 * in_features)[:, :in_features]
        torch.testing.assert_close(
            layer(wide), F.linear(wide, weight, layer.bias), atol=1e-5, rtol=1e-5
        )
        # So does a batch of rows with leading dimensions.
        batched = torch.randn(2, rows, in_features)
        torch.testing.assert_close(
            layer(batched), F.linear(batched, weight, layer.bias), atol=1e-5, rtol=1e-5
        )


@needs_onednn
def test_prepacking_replaces_the_weight_and_keeps_its_values() -> None:
    """One copy: the oneDNN tensor is the layer's weight, not a second one beside it; the
    state dict and prepack=False give back the exact original values."""
    layer = make_linear(16, 12, bias=True)
    original = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.process_weights_after_loading()
    assert layer.weight.is_mkldnn
    assert [name for name, _ in layer.named_parameters()] == ["weight", "bias"]
    state = layer.state_dict()
    assert not state["weight"].is_mkldnn
    assert all(torch.equal(state[k], original[k]) for k in original)
    layer.process_weights_after_loading(prepack=False)
    assert not layer.is_prepacked
    assert torch.equal(layer.weight, original["weight"])


@needs_onednn
def test_a_state_dict_loads_into_a_prepacked_layer() -> None:
    source, target = make_linear(8, 6, bias=True, seed=1), make_linear(8, 6, bias=True, seed=2)
    target.process_weights_after_loading()
    target.load_state_dict(source.state_dict())
    assert target.is_prepacked
    x = torch.randn(3, 8)
    with torch.inference_mode():
        torch.testing.assert_close(target(x), source(x), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_tied_layer_is_prepacked_with_its_rows_readable_in_place() -> None:
    """A tied ``lm_head``: the packed weight also gives the embedding's rows, read from
    oneDNN's buffer (no second copy), and goes back to the plain matrix on prepack=False."""
    lm_head = make_linear(4, 100, bias=False)
    lm_head.tied = True
    dense = lm_head.weight.detach().clone()
    lm_head.process_weights_after_loading()
    assert lm_head.weight.is_mkldnn
    rows = lm_head.weight.packed_rows
    assert rows.untyped_storage().data_ptr() == torch.ops.mkldnn.data_ptr(lm_head.weight)
    ids = torch.tensor([0, 1, 63, 64, 99, 5, 5])
    assert torch.equal(weight_rows(lm_head.weight, ids), dense[ids])
    x = torch.randn(3, 4)
    with torch.inference_mode():
        torch.testing.assert_close(lm_head(x), F.linear(x, dense), atol=1e-5, rtol=1e-5)
    lm_head.process_weights_after_loading(prepack=False)
    assert not lm_head.is_prepacked and torch.equal(lm_head.weight, dense)


def test_without_onednn_the_layer_is_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "onednn_linear_available", lambda weight: False)
    layer = make_linear(8, 5, bias=True)
    layer.process_weights_after_loading()
    assert not layer.is_prepacked
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_prepack_false_goes_back_to_row_major() -> None:
    layer = make_linear(8, 5, bias=False)
    layer.process_weights_after_loading()
    layer.process_weights_after_loading(prepack=False)
    assert not layer.is_prepacked
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_half_precision_weights_are_not_packed() -> None:
    layer = make_linear(8, 5, bias=False).to(torch.bfloat16)
    layer.process_weights_after_loading()
    assert not layer.is_prepacked
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn
def test_loaded_model_is_prepacked(tiny_llama_path) -> None:
    from minivllm.attention import get_backend
    from minivllm.models.loader import load_model

    model, _ = load_model(tiny_llama_path, get_backend("torch")(), torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.is_prepacked for m in linears)
    # One copy of each projection: no row-major matrix is left but the (untied) embedding's.
    dense = [name for name, p in model.named_parameters() if p.dim() == 2 and not p.is_mkldnn]
    assert not model.config.tie_word_embeddings and dense == ["embed_tokens.weight"]
