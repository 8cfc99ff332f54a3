"""One way to turn a conversation into a prompt, for `LLM.chat`, the CLI and the server."""

from __future__ import annotations


def chat_prompt(
    tokenizer,
    conversation: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> dict:
    """``[{"role": "user", "content": ...}, ...]`` formatted with the tokenizer's chat
    template, ready for the assistant's reply: ``{"prompt": text, "prompt_token_ids": ids}``.

    The template writes every special token itself (a BOS included, where the model wants
    one), so the text is tokenized with ``add_special_tokens=False``: a second BOS would
    change what the model sees. (vLLM's ``/tokenize`` lets a client ask for them anyway,
    and for the template without the assistant's header, or with the final message left
    open to be continued.)"""
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    return {"prompt": text, "prompt_token_ids": ids}
