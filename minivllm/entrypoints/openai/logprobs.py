"""The engine's logprobs (one dict per token: token id -> `Logprob`) in OpenAI's shapes:
the legacy completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and chat's
``content: [{token, logprob, bytes, top_logprobs}]`` (vLLM's serving code builds the same).
A logprob of -inf is sent as -9999.0, as vLLM does: JSON has no infinity."""

from __future__ import annotations

from minivllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionChoice,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobsJSON,
)
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput

_FLOOR = -9999.0


def _json_logprob(logprob: Logprob) -> float:
    return max(logprob.logprob, _FLOOR)


def completion_logprobs(
    token_ids: list[int], rows: PromptLogprobs, first_token_text: str, text_offset: int
) -> CompletionLogProbs:
    """One entry per token; row ``None`` (an echoed prompt's first token: nothing predicts
    it) has no logprob, and its text is ``first_token_text``. Offsets count from
    ``text_offset`` (the choice's text streamed before these tokens)."""
    result = CompletionLogProbs()
    for token_id, row in zip(token_ids, rows):
        text = first_token_text if row is None else row[token_id].decoded_token or ""
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if row is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(_json_logprob(row[token_id]))
            # The chosen token and the top ones, by text (vLLM's: tokens with the same
            # text keep the last one's logprob).
            result.top_logprobs.append(
                {(p.decoded_token or ""): _json_logprob(p) for p in row.values()}
            )
    return result


def prompt_logprobs_json(rows: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's ``prompt_logprobs`` field: the engine's rows as they are, by token id
    (``None``, the field's null, where the request did not ask for them)."""
    if rows is None:
        return None
    return [
        None
        if row is None
        else {
            token_id: PromptLogprob(
                logprob=_json_logprob(p), rank=p.rank, decoded_token=p.decoded_token
            )
            for token_id, p in row.items()
        }
        for row in rows
    ]


def chat_logprobs(
    token_ids: list[int], rows: list[dict[int, Logprob]], num_top: int
) -> ChatCompletionLogProbs:
    """Each token with its ``num_top`` most likely alternatives, most likely first."""
    content = []
    for token_id, row in zip(token_ids, rows):
        top = sorted((p for p in row.values() if p.rank <= num_top), key=lambda p: p.rank)
        content.append(
            ChatCompletionLogProbsContent(
                **_chat_logprob(row[token_id]).model_dump(),
                top_logprobs=[_chat_logprob(p) for p in top[:num_top]],
            )
        )
    return ChatCompletionLogProbs(content=content)


def _chat_logprob(logprob: Logprob) -> ChatCompletionLogProb:
    text = logprob.decoded_token or ""
    return ChatCompletionLogProb(
        token=text, logprob=_json_logprob(logprob), bytes=list(text.encode("utf-8"))
    )


class CompletionChoices:
    """A completion's choices from engine outputs, a stream's chunk after chunk: with
    ``echo`` the prompt (and its logprobs, with ``logprobs``) comes before each choice's
    first text; each choice's ``text_offset`` goes on from its tokens sent before.
    ``prompt_only`` (``echo`` with ``max_tokens: 0``): the one generated token is dropped.
    ``send_prompt_logprobs`` (the request's ``prompt_logprobs``): each choice carries them."""

    def __init__(
        self,
        tokenizer,
        echo: bool,
        logprobs: int | None,
        prompt_only: bool,
        send_prompt_logprobs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.echo = echo
        self.logprobs = logprobs
        self.prompt_only = prompt_only
        self.send_prompt_logprobs = send_prompt_logprobs
        # Choice index -> where its next token's text starts: the tokens' texts so far, end
        # to end (the choice's text too, for a byte-level tokenizer; vLLM's offsets).
        self.text_offset: dict[int, int] = {}
        self.prompt_logprobs: PromptLogprobs | None = None  # DELTA sends them once

    def __call__(self, output: RequestOutput) -> list[CompletionChoice]:
        self.prompt_logprobs = output.prompt_logprobs or self.prompt_logprobs
        return [self._choice(output, completion) for completion in output.outputs]

    def _choice(self, output: RequestOutput, completion: CompletionOutput) -> CompletionChoice:
        text, token_ids, rows = completion.text, completion.token_ids, completion.logprobs or []
        if self.prompt_only:
            text, token_ids, rows = "", [], []
        first = completion.index not in self.text_offset
        offset = self.text_offset.setdefault(completion.index, 0)
        if first and self.echo:
            text = self._prompt_text(output) + text
            if self.logprobs is not None:
                token_ids = output.prompt_token_ids + token_ids
                rows = (self.prompt_logprobs or [None] * len(output.prompt_token_ids)) + rows
        logprobs = None
        if self.logprobs is not None:
            first_text = self._token_text(token_ids[0]) if token_ids else ""
            logprobs = completion_logprobs(token_ids, rows, first_text, offset)
            self.text_offset[completion.index] += sum(map(len, logprobs.tokens))
        prompt_logprobs = self.prompt_logprobs if self.send_prompt_logprobs else None
        return CompletionChoice(
            index=completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=prompt_logprobs_json(prompt_logprobs),
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _token_text(self, token_id: int) -> str:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        return self.tokenizer.convert_tokens_to_string([token])
