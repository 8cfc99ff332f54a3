"""minivllm: vLLM's engine core (continuous batching over a paged KV cache), small enough
to read in an afternoon."""

from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

EngineArgs = EngineConfig  # vLLM's name for the same thing


def __getattr__(name: str):
    """Beam search's output types, loaded when first asked for: importing the package
    loads the engine core alone (beam search is a feature: request_groups.py)."""
    if name in ("BeamSearchOutput", "BeamSearchSequence"):
        from minivllm import beam_search

        return getattr(beam_search, name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
