"""Structured outputs: JSON schema, regex, choice and grammar as token masks in the batch.

`manager.StructuredOutputManager` keeps each constrained request's matcher and fills the
step's bitmask; `backend` is the seam to a grammar library, `guidance` the llguidance
implementation. The mask is applied in sampler.py (`apply_grammar_bitmask`).
"""

from minivllm.structured_output.manager import (
    GrammarBitmask,
    StructuredOutputManager,
    StructuredOutputStats,
    validate_structured_outputs,
)

__all__ = [
    "GrammarBitmask",
    "StructuredOutputManager",
    "StructuredOutputStats",
    "validate_structured_outputs",
]
