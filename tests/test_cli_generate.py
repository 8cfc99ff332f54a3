"""`minivllm generate`: the chat template by default when the model has one, raw text
with --no-chat, and a note when an answer is cut by --max-tokens (tiny random model)."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from minivllm.cli import main
from minivllm.engine import LLMEngine

TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_path(tiny_llama_path, tmp_path_factory):
    """The tiny checkpoint with a chat template, like SmolLM2-Instruct's."""
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_llama_path, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def sent_prompts(monkeypatch):
    """What the CLI hands the engine, in order."""
    sent = []
    add_request = LLMEngine.add_request

    def recording(self, request_id, prompt, *args, **kwargs):
        sent.append(prompt)
        return add_request(self, request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    return sent


def generate(model, *flags):
    argv = ["generate", "w5 w6", "--model", str(model), "--num-kv-blocks", "16"]
    return main(argv + ["--max-tokens", "2", *flags])


def test_chat_template_is_the_default_when_the_model_has_one(chat_model_path, sent_prompts):
    assert generate(chat_model_path) == 0
    assert sent_prompts[0]["prompt"] == "w1 w5 w6 w9"


def test_no_chat_sends_the_raw_text(chat_model_path, sent_prompts):
    assert generate(chat_model_path, "--no-chat") == 0
    assert sent_prompts == ["w5 w6"]


def test_a_model_without_template_gets_raw_text(tiny_llama_path, sent_prompts, capsys):
    assert generate(tiny_llama_path) == 0
    assert sent_prompts == ["w5 w6"]
    assert generate(tiny_llama_path, "--chat") == 2
    assert "no chat template" in capsys.readouterr().err


def test_an_answer_cut_by_max_tokens_says_so(tiny_llama_path, capsys):
    assert generate(tiny_llama_path, "--ignore-eos") == 0
    assert "[cut at --max-tokens 2; raise it for the rest]" in capsys.readouterr().out


def test_help_names_the_raw_completion_flag(capsys):
    assert main(["generate", "--help"]) == 0
    assert "--no-chat" in capsys.readouterr().out
