"""minivllm: vLLM's engine core (continuous batching over a paged KV cache), small enough
to read in an afternoon."""

from minivllm.beam_search import BeamSearchOutput, BeamSearchSequence
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
