"""One way to turn a conversation into a prompt, for `LLM.chat`, the CLI and the server."""

from __future__ import annotations


def chat_prompt(tokenizer, conversation: list[dict]) -> dict:
    """``[{"role": "user", "content": ...}, ...]`` formatted with the tokenizer's chat
    template, ready for the assistant's reply: ``{"prompt": text, "prompt_token_ids": ids}``.

    The template writes every special token itself (a BOS included, where the model wants
    one), so the text is tokenized with ``add_special_tokens=False``: a second BOS would
    change what the model sees."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": ids}
