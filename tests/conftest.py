"""Test set-up shared by every test module.

The numba CUDA simulator is chosen once, when `numba.cuda` is first imported, so it has to
be switched on here, before any test module imports a kernel. `benchmarks/gpu_check.py`
sets MINIVLLM_REAL_GPU=1 to run the same tests on a real GPU instead.
"""

import os
import sys

if os.environ.get("MINIVLLM_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # The simulator runs each CUDA thread as a Python thread that busy-waits holding the
    # GIL; switching threads often makes it 5-16x faster (../shared/NOTES-kernels.md).
    sys.setswitchinterval(1e-5)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import pytest  # noqa: E402

from tests.helpers import (  # noqa: E402
    CHAT_TEMPLATE,
    ENGINE_OPTIONS,
    MODEL_NAME,
    TINY_ARCHITECTURES,
    make_tiny_chat_checkpoint,
    make_tiny_checkpoint,
)


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def tiny_model_path(request, tmp_path_factory):
    """A random 2-layer checkpoint per supported architecture family."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct checkpoint (converted once, then cached)."""
    from minivllm.models.model_files import default_model_path

    return default_model_path()


# A real `minivllm serve` of the tiny chat model on 127.0.0.1, for the server tests. Module
# scope: each test module that asks for it gets its own checkpoint, server and offline LLM
# to compare with, and the server stops when that module's tests end. A module with other
# needs defines its own fixture of the same name, which takes precedence.
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_chat_checkpoint(tmp_path_factory.mktemp("served-llama"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_path):
    from minivllm import EngineConfig, LLMEngine
    from minivllm.entrypoints.openai.api_server import BackgroundServer

    engine = LLMEngine(EngineConfig(model=str(model_path), **ENGINE_OPTIONS))
    with BackgroundServer(engine, model_name=MODEL_NAME) as server:
        yield server


@pytest.fixture(scope="module")
def llm(model_path):
    from minivllm import LLM

    return LLM(str(model_path), **ENGINE_OPTIONS)


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
