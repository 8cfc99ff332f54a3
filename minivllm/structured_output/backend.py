"""The seam between the engine and a grammar library (vLLM's ``StructuredOutputBackend``
and ``StructuredOutputGrammar``, in vllm/v1/structured_output/backend_types.py).

A backend turns a `StructuredOutputsParams` into a compiled grammar, once per distinct
constraint; a `Grammar` is one request's matcher over it: where in the language the
request's output is so far. The engine only ever asks a grammar four things: fill the
mask of the tokens allowed next, accept tokens (the ones sampled), check tokens without
accepting them, roll back. Everything library-specific stays behind these two classes;
`guidance.py` is the one implementation (llguidance).
"""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.sampling_params import StructuredOutputsParams


class Grammar(Protocol):
    """One request's matcher: its position in the language."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance past these tokens; False (and nothing accepted) if one is not allowed."""

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of these tokens, from the first, would be accepted; nothing moves."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``: one bit per token id,
        32 per int32 word (bit ``i % 32`` of word ``i // 32`` is token ``i``)."""

    def is_terminated(self) -> bool:
        """The output is complete: nothing but EOS can follow (EOS included, if accepted)."""


class CompiledGrammar(Protocol):
    """A constraint compiled once; each request gets its own `Grammar` from it."""

    def new_matcher(self) -> Grammar: ...


class StructuredOutputBackend(Protocol):
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError, naming the field, if ``params`` cannot compile. Quick: runs
        when the request is added, before any work is queued."""

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The slow part (milliseconds to seconds): runs on the compile thread."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` booleans from one bitmask row (for tests and the notebook)."""
    return unpack_bitmask(bitmask_row[None], vocab_size)[0]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, vocab_size]`` booleans, all rows at once."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # [rows, words, 32]
    return allowed.flatten(1)[:, :vocab_size].bool()
