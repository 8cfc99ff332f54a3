"""One chat-prompt path: the template's own BOS, never a second one."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing

from minivllm.chat import chat_prompt
from tests.helpers import make_tiny_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}w{{ loop.index }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)


@pytest.fixture
def bos_adding_tokenizer():
    """Like Llama's: encoding adds <s> in front, and the chat template writes one too."""
    tokenizer = make_tiny_tokenizer()
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = TEMPLATE
    assert tokenizer("w5").input_ids == [tokenizer.bos_token_id, 8]  # it does add one
    return tokenizer


def test_chat_prompt_has_exactly_one_bos(bos_adding_tokenizer):
    bos = bos_adding_tokenizer.bos_token_id
    prompt = chat_prompt(bos_adding_tokenizer, [{"role": "user", "content": "w5 w6"}])
    assert prompt["prompt"] == "<s>w1 w5 w6 w9"
    assert prompt["prompt_token_ids"] == [bos, 4, 8, 9, 12]


def test_chat_prompt_refuses_a_tokenizer_without_template():
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(make_tiny_tokenizer(), [{"role": "user", "content": "w1"}])
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(None, [{"role": "user", "content": "w1"}])
