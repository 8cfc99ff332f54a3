"""The loaded model holds each weight once: the tied embedding / LM head matrix included,
which the embedding reads in place from the LM head's prepacked buffer
(minivllm/models/linear.py). Counted as the bytes of distinct storages the model holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.attention import get_backend
from minivllm.distributed import TensorParallelGroup
from minivllm.models import linear as linear_module
from minivllm.models.linear import Linear, onednn_linear_available, packed_rows
from minivllm.models.loader import load_model
from tests.helpers import make_tiny_checkpoint

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(torch.empty(1)), reason="this torch build has no oneDNN linear"
)
# oneDNN's layouts on these CPUs are the row-blocked ones `packed_rows` reads.
ROW_BLOCKED_CPU = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(scope="module")
def tied_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")  # tied


def load(path, tp: TensorParallelGroup | None = None):
    model, _ = load_model(path, get_backend("torch")(), torch.float32, torch.device("cpu"), tp)
    return model


def storages(model: torch.nn.Module) -> dict[int, int]:
    """Address -> bytes of every distinct buffer behind the model's tensors: parameters,
    buffers, and any tensor kept as an attribute of a module or a parameter (a prepacked
    copy, a view). A oneDNN tensor has no torch storage: its own buffer is counted."""
    found: dict[int, int] = {}

    def add(tensor: torch.Tensor) -> None:
        if tensor.is_mkldnn:
            found[torch.ops.mkldnn.data_ptr(tensor)] = torch.ops.mkldnn._nbytes(tensor)
        else:
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()

    holders = list(model.modules()) + list(model.parameters())
    for tensor in list(model.parameters()) + list(model.buffers()):
        add(tensor)
    for holder in holders:
        for value in vars(holder).values():
            if isinstance(value, torch.Tensor):
                add(value)
    return found


def tied_weight_address(model) -> int:
    weight = model.lm_head.weight
    if weight.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(weight)
    return weight.untyped_storage().data_ptr()


def assert_weights_held_once(model) -> None:
    """Bytes held = 4 per parameter (tied: counted once) + the non-weight buffers."""
    held = storages(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert param_bytes + buffer_bytes == sum(held.values())


@needs_onednn
def test_the_tied_matrix_is_one_prepacked_storage_the_embedding_reads(tied_path) -> None:
    model = load(tied_path)
    assert model.config.tie_word_embeddings
    assert model.embed_tokens.weight is model.lm_head.weight
    assert model.lm_head.is_prepacked == ROW_BLOCKED_CPU
    # The embedding's rows view the LM head's buffer: the same address, held once.
    rows = getattr(model.lm_head.weight, "packed_rows", None)
    if rows is not None:
        assert rows.untyped_storage().data_ptr() == tied_weight_address(model)
    # One storage per parameter (the tied one counted once) and per buffer, nothing more.
    assert len(storages(model)) == len(list(model.parameters())) + len(list(model.buffers()))
    assert_weights_held_once(model)


@needs_onednn
def test_prepacked_tied_model_computes_what_the_plain_one_does(tied_path) -> None:
    model, plain = load(tied_path), load(tied_path)
    plain.process_weights_after_loading(prepack=False)
    assert plain.embed_tokens.weight is plain.lm_head.weight
    assert not plain.lm_head.weight.is_mkldnn
    matrix = plain.lm_head.weight.detach()
    ids = torch.tensor([0, 1, 63, 64, 65, 255, 7, 7])
    hidden = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), matrix[ids])
        assert torch.equal(plain.embed_tokens(ids), matrix[ids])
        torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, matrix))
    assert_weights_held_once(plain)
    # And back: prepacked again, still one storage.
    plain.process_weights_after_loading()
    assert plain.embed_tokens.weight is plain.lm_head.weight
    assert_weights_held_once(plain)
    with torch.inference_mode():
        assert torch.equal(plain.embed_tokens(ids), matrix[ids])


@needs_onednn
def test_a_state_dict_round_trips_through_the_prepacked_tied_model(tied_path) -> None:
    model = load(tied_path)
    state = model.state_dict()
    assert not any(t.is_mkldnn for t in state.values())
    assert torch.equal(state["embed_tokens.weight"], state["lm_head.weight"])
    state = {k: v.clone() for k, v in state.items()}
    state["embed_tokens.weight"] *= 2  # tied: one matrix, so both keys carry it
    state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state)
    assert model.lm_head.is_prepacked == ROW_BLOCKED_CPU
    assert model.embed_tokens.weight is model.lm_head.weight
    ids = torch.arange(model.config.vocab_size)
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), state["embed_tokens.weight"])
        torch.testing.assert_close(
            model.compute_logits(hidden), F.linear(hidden, state["lm_head.weight"])
        )
    assert_weights_held_once(model)


@needs_onednn
def test_an_untied_model_holds_each_matrix_once_too(tiny_llama_path) -> None:
    model = load(tiny_llama_path)
    assert not model.config.tie_word_embeddings
    assert model.embed_tokens.weight is not model.lm_head.weight
    assert not model.embed_tokens.weight.is_mkldnn and model.lm_head.is_prepacked
    assert_weights_held_once(model)


@needs_onednn
def test_where_rows_cannot_be_read_in_place_the_tied_matrix_stays_plain_and_single(
    tied_path, monkeypatch
) -> None:
    monkeypatch.setattr(linear_module, "packed_rows", lambda packed, dense: None)
    model = load(tied_path)
    assert not model.lm_head.is_prepacked
    assert model.embed_tokens.weight is model.lm_head.weight
    assert all(m.is_prepacked for m in model.modules() if isinstance(m, Linear) and not m.tied)
    assert_weights_held_once(model)


class OneRankView(TensorParallelGroup):
    """Rank ``rank`` of ``size`` in this process: each collective hands back this rank's
    part (as in test_parallel_layers.py), the test adds the parts up."""

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x):
        return x


@needs_onednn
def test_each_tensor_parallel_rank_holds_its_vocabulary_slice_once(tied_path) -> None:
    whole = load(tied_path)
    whole.process_weights_after_loading(prepack=False)
    matrix = whole.lm_head.weight.detach()
    ids = torch.tensor([0, 127, 128, 255, 3])
    embedded = 0
    for rank in range(2):
        model = load(tied_path, OneRankView(rank, 2))
        assert model.embed_tokens.weight is model.lm_head.weight
        assert model.lm_head.weight.shape == (128, model.config.hidden_size)
        assert_weights_held_once(model)
        with torch.inference_mode():
            embedded = embedded + model.embed_tokens(ids)
            rows = slice(128 * rank, 128 * (rank + 1))
            hidden = torch.randn(2, model.config.hidden_size)
            torch.testing.assert_close(model.compute_logits(hidden), hidden @ matrix[rows].T)
    assert torch.equal(embedded, matrix[ids])


@needs_onednn
@pytest.mark.parametrize("shape", [(100, 24), (3, 5), (1000, 96), (256, 64), (129, 64)])
def test_packed_rows_are_the_matrix_rows(shape) -> None:
    """Shapes oneDNN pads (rows to a block, features too): the view skips the padding."""
    dense = torch.randn(shape)
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, None)
    rows = packed_rows(packed, dense)
    if ROW_BLOCKED_CPU:
        assert rows is not None
    if rows is not None:
        ids = torch.arange(shape[0])
        assert torch.equal(rows[ids // rows.shape[1], ids % rows.shape[1]], dense)
