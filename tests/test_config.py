"""EngineConfig defaults that are decided, not fixed: the attention backend and dtype."""

import torch

from minivllm import LLM, EngineConfig


def test_auto_backend_is_the_numba_kernel_on_cpu_fp32():
    assert EngineConfig().attention_backend_name == "numba-cpu"
    assert EngineConfig(attention_backend="torch").attention_backend_name == "torch"
    # numba-cpu runs fp32 only, so half precision on CPU falls back to the reference.
    assert EngineConfig(dtype="float16").attention_backend_name == "torch"


def test_auto_dtype_is_fp32_on_cpu():
    assert EngineConfig().torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16


def test_engine_reports_the_backend_it_runs(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=8)
    backend = llm.llm_engine.executor.model.layers[0].self_attn.backend
    assert backend.name == "numba-cpu"
