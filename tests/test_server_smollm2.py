"""The real SmolLM2-135M-Instruct behind `minivllm serve`, through the official openai
client: greedy text, streamed or not, equals `LLM.generate` and `LLM.chat` in process."""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.entrypoints.openai.api_server import BackgroundServer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

OPTIONS = dict(num_kv_blocks=256, max_num_seqs=8)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention is"]
QUESTIONS = ["What is continuous batching?", "Name three prime numbers."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), **OPTIONS)


@pytest.fixture(scope="module")
def client(smollm2_path):
    engine = LLMEngine(EngineConfig(model=str(smollm2_path), **OPTIONS))
    with BackgroundServer(engine, model_name="smollm2") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_equal_llm_generate(llm, client):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for prompt, want in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        args = dict(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        reply = client.completions.create(**args)
        assert reply.choices[0].text == want.outputs[0].text
        assert reply.choices[0].finish_reason == want.outputs[0].finish_reason
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        assert reply.usage.completion_tokens == len(want.outputs[0].token_ids)
        chunks = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text


def test_chat_equals_llm_chat(llm, client):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for conversation, want in zip(conversations, llm.chat(conversations, params, use_tqdm=False)):
        args = dict(
            model="smollm2", messages=conversation, max_completion_tokens=MAX_TOKENS, temperature=0
        )
        reply = client.chat.completions.create(**args)
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        assert reply.usage.completion_tokens == len(want.outputs[0].token_ids)
        chunks = list(
            client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.outputs[0].text
        assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
