"""The completions and chat routes' logic: request body -> engine request -> response body
or SSE stream (vLLM's ``serving_completion.py`` / ``serving_chat.py``, in one file), and
the tokenizer routes' (``serving_tokenization.py``): the same prompts' ids, no engine.

A plain response is one FINAL_ONLY request awaited to the end. A stream is a DELTA request:
one ``data: {json}`` event per engine output that brings new text, the finish reason in
the last choice event (with ``n > 1``, an event holds the choices, by ``index``, that
brought something in that step), then (with ``stream_options.include_usage``) a usage event with
``choices: []``, then ``data: [DONE]``. An error after the stream started goes in-band as
``data: {"error": ...}``, since the 200 status is already sent.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from minivllm.chat import chat_prompt
from minivllm.engine import Prompt
from minivllm.entrypoints.async_llm import AsyncLLM, RequestStream
from minivllm.entrypoints.live import LiveRequests
from minivllm.entrypoints.openai.errors import RequestError, error_from_exception
from minivllm.entrypoints.openai.logprobs import (
    CompletionChoices,
    chat_logprobs,
    prompt_logprobs_json,
)
from minivllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    SamplingFields,
    TextContentPart,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
)
from minivllm.entrypoints.openai.tool_calls import (
    forces_tool_call,
    new_tool_call_id,
    parse_tool_calls,
)
from minivllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("minivllm.serve")


@dataclass
class Accepted:
    """A request the engine took: its stream and what every response chunk repeats."""

    request_id: str
    stream: RequestStream
    created: int
    model: str


class OpenAIServing:
    """Turns API requests into engine requests for one served model."""

    def __init__(
        self, async_llm: AsyncLLM, model_names: str | list[str], live: LiveRequests
    ) -> None:
        self.async_llm = async_llm
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.model_name = self.model_names[0]  # what replies name when a request names none
        self.live = live

    # --- completions ---------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest):
        """A `CompletionResponse`, or an SSE event iterator when streaming."""
        _refuse_unless(request.suffix in (None, ""), "suffix")
        _refuse_unless(
            request.best_of in (None, 1), "best_of", " (only best_of=1: vLLM v1 removed it; use n)"
        )
        prompt = _single_prompt(request.prompt)
        label = prompt if isinstance(prompt, str) else f"[{len(prompt)} token ids]"
        if isinstance(prompt, str):
            self._check_text_length(len(prompt), "prompt")
        # echo with max_tokens 0 (lm-eval scoring a text): generate one token, show none.
        prompt_only = request.echo and request.max_tokens == 0
        max_tokens = 1 if prompt_only else request.max_tokens
        accepted = await self._accept(
            "cmpl", request, max_tokens, self._completion_prompt(prompt, request), label
        )
        choices = CompletionChoices(
            self.async_llm.tokenizer,
            request.echo,
            request.logprobs,
            prompt_only,
            send_prompt_logprobs=request.prompt_logprobs is not None,
        )
        if request.stream:
            return self._completion_events(
                accepted, choices, request.include_usage_in_stream, count_output=not prompt_only
            )
        final = await accepted.stream.collect()
        self.live.update(final)
        usage = _usage(final)
        if prompt_only:
            usage = UsageInfo.of(usage.prompt_tokens, 0)
        return _completion_response(accepted, choices(final), usage)

    def _completion_prompt(self, prompt: str | list[int], request) -> Callable[[], Prompt]:
        def build() -> Prompt:  # runs on the tokenizer thread
            if isinstance(prompt, str):
                ids = self.async_llm.tokenizer(prompt).input_ids
                engine_prompt = {"prompt": prompt, "prompt_token_ids": ids}
            else:
                engine_prompt = {"prompt_token_ids": prompt}
            self._check_context_length(engine_prompt, request.max_tokens, "prompt", "max_tokens")
            return engine_prompt

        return build

    async def _completion_events(
        self,
        accepted: Accepted,
        choices: CompletionChoices,
        include_usage: bool,
        count_output: bool,
    ):
        def chunk(output: RequestOutput) -> CompletionResponse:
            return _completion_response(accepted, choices(output))

        async for event in self._events(accepted, chunk, None, include_usage, count_output):
            yield event

    # --- chat ----------------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest):
        messages = self._conversation(request.messages)
        max_tokens = request.requested_max_tokens
        accepted = await self._accept(
            "chatcmpl",
            request,
            max_tokens,
            self._chat_prompt(messages, max_tokens),
            messages[-1]["content"],
        )
        top = request.top_logprobs or 0
        tool_choice = (
            request.tool_choice if forces_tool_call(request.tools, request.tool_choice) else None
        )
        if request.stream:
            return self._chat_events(
                accepted, request.n, request.include_usage_in_stream, request.logprobs, top,
                tool_choice,
            )  # fmt: skip
        final = await accepted.stream.collect()
        self.live.update(final)
        return ChatCompletionResponse(
            id=accepted.request_id,
            created=accepted.created,
            model=accepted.model,
            choices=[
                ChatChoice(
                    index=completion.index,
                    message=_chat_message(completion.text, tool_choice),
                    logprobs=_chat_logprobs(completion, top),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                for completion in final.outputs
            ],
            usage=_usage(final),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
        )

    def _chat_prompt(self, messages: list[dict], max_tokens: int | None) -> Callable[[], Prompt]:
        def build() -> Prompt:  # runs on the tokenizer thread
            try:
                engine_prompt = chat_prompt(self.async_llm.tokenizer, messages)
            except ValueError as e:  # no chat template
                raise RequestError(str(e), "messages") from e
            self._check_context_length(
                engine_prompt, max_tokens, "messages", "max_completion_tokens"
            )
            return engine_prompt

        return build

    async def _chat_events(
        self,
        accepted: Accepted,
        n: int,
        include_usage: bool,
        logprobs: bool,
        top: int,
        tool_choice=None,
    ):
        tool_deltas = _ToolCallDeltas(tool_choice) if tool_choice is not None else None

        def chunk(output: RequestOutput) -> ChatCompletionChunk | None:
            choices = [
                ChatStreamChoice(
                    index=completion.index,
                    delta=(
                        tool_deltas(completion)
                        if tool_deltas is not None
                        else DeltaMessage(content=completion.text)
                    ),
                    logprobs=_chat_logprobs(completion, top) if logprobs else None,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                for completion in output.outputs
            ]
            if tool_deltas is not None:  # "required" says nothing until a call is complete
                choices = [
                    c for c in choices
                    if c.delta.tool_calls or c.delta.content or c.finish_reason is not None
                ]  # fmt: skip
                if not choices:
                    return None
            return ChatCompletionChunk(
                id=accepted.request_id,
                created=accepted.created,
                model=accepted.model,
                choices=choices,
            )

        # The role comes with the first output, not before: a client timing the first
        # event (vllm bench serve) then measures the real time to first token.
        role = ChatCompletionChunk(
            id=accepted.request_id,
            created=accepted.created,
            model=accepted.model,
            choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(n)
            ],
        )
        async for event in self._events(accepted, chunk, role, include_usage):
            yield event

    # --- /tokenize and /detokenize (vLLM's extra routes, outside /v1) ---------------------

    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The ids the completions (``prompt``) or chat (``messages``) route would give
        this input. A prompt longer than ``max_model_len`` tokens is counted, not refused
        (finding that out is what a client asks for); only a text too long to fit
        whatever it tokenizes to is refused, as on the other routes."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            encode = self._chat_ids(request)
        else:
            self._check_text_length(len(request.prompt), "prompt")
            encode = self._text_ids(request)
        tokenizer = self.async_llm.tokenizer

        def tokenize() -> TokenizeResponse:  # runs on the tokenizer thread
            ids = encode()
            strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
            return TokenizeResponse(
                count=len(ids), max_model_len=self.async_llm.max_model_len, tokens=ids,
                token_strs=strs,
            )  # fmt: skip

        return await self.async_llm.run_on_tokenizer_thread(tokenize)

    def _text_ids(self, request: TokenizeCompletionRequest) -> Callable[[], list[int]]:
        def encode() -> list[int]:
            tokenizer = self.async_llm.tokenizer
            return tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens
            ).input_ids

        return encode

    def _chat_ids(self, request: TokenizeChatRequest) -> Callable[[], list[int]]:
        if request.continue_final_message and request.add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false to continue the final message)",
                "continue_final_message",
            )
        messages = self._conversation(request.messages)

        def encode() -> list[int]:
            try:
                prompt = chat_prompt(
                    self.async_llm.tokenizer,
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    add_special_tokens=request.add_special_tokens,
                )
            except ValueError as e:  # no chat template, or no final message to continue
                raise RequestError(str(e), "messages") from e
            return prompt["prompt_token_ids"]

        return encode

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``tokens``, special tokens included (vLLM's ``/detokenize``). Ids
        outside the vocabulary are refused, by the engine's own rule for prompt ids."""
        self.check_model(request.model)
        vocab_size = self.async_llm.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"tokens {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens"
            )

        def decode() -> DetokenizeResponse:  # runs on the tokenizer thread
            return DetokenizeResponse(prompt=self.async_llm.tokenizer.decode(request.tokens))

        return await self.async_llm.run_on_tokenizer_thread(decode)

    # --- shared --------------------------------------------------------------------------

    def _conversation(self, messages: list[ChatMessage]) -> list[dict]:
        """The messages as the chat template takes them, refused before any tokenizing if
        their text cannot fit."""
        conversation = [{"role": m.role, "content": _text_content(m.content)} for m in messages]
        self._check_text_length(sum(len(m["content"]) for m in conversation), "messages")
        return conversation

    async def _accept(
        self,
        prefix: str,
        request: SamplingFields,
        max_tokens: int | None,
        prompt: Callable[[], Prompt],
        label: str,
    ) -> Accepted:
        """Check the model and the parameters, tokenize, and hand the request to the
        engine. Every bad input raises before the engine does any work for it. The prompt
        is built on the tokenizer thread: neither the event loop (other streams) nor the
        engine thread (other requests' steps) waits for it. ``label``: the prompt as the
        live page lists it."""
        self.check_model(request.model)
        params = request.engine_params(max_tokens, self.async_llm.max_model_len)
        engine_prompt = await self.async_llm.run_on_tokenizer_thread(prompt)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = await self.async_llm.add_request(request_id, engine_prompt, params)
        self.live.add(request_id, params, label)
        return Accepted(request_id, stream, int(time.time()), request.model or self.model_name)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in self.model_names)
            raise RequestError(
                f"The model `{model}` does not exist. Served: {served}.", "model", status=404
            )

    def _check_text_length(self, num_chars: int, param: str) -> None:
        """vLLM's pre-check, before any tokenizing: no token is longer than the longest
        one in the vocabulary, so a text longer than ``max_model_len`` of those cannot
        fit. Refusing it here keeps a 10 MB prompt from costing seconds of tokenizing."""
        limit = self.async_llm.max_model_len * self.async_llm.max_chars_per_token
        if num_chars > limit:
            raise RequestError(
                f"This model's maximum context length is {self.async_llm.max_model_len} "
                f"tokens, and no token is longer than {self.async_llm.max_chars_per_token} "
                f"characters, but your request has {num_chars} characters. Please reduce "
                "the length of the input.",
                param,
            )

    def _check_context_length(
        self, prompt: dict, max_tokens: int | None, prompt_param: str, max_tokens_param: str
    ) -> None:
        """vLLM's rule and wording: the prompt must leave room for one token, and prompt +
        max_tokens must fit in the context."""
        limit, num_prompt = self.async_llm.max_model_len, len(prompt["prompt_token_ids"])
        if num_prompt >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt} input tokens. Please reduce the length of the "
                "input messages.",
                prompt_param,
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{num_prompt} input tokens ({max_tokens} > {limit} - {num_prompt}).",
                max_tokens_param,
            )

    async def _events(
        self, accepted: Accepted, chunk, first, include_usage: bool, count_output: bool = True
    ):
        """The SSE events of one stream: ``first`` (if any) with the first output, a
        chunk per output that brings text or a finish (of the choices that do), usage,
        [DONE]. Usage counts the prompt once and every choice's tokens (none when not
        ``count_output``: the one token ``echo`` with ``max_tokens: 0`` generates and
        drops)."""
        num_prompt = num_output = 0
        try:
            async for output in accepted.stream:
                self.live.update(output)
                num_prompt = len(output.prompt_token_ids)
                if count_output:
                    num_output += sum(len(c.token_ids) for c in output.outputs)
                if first is not None:
                    yield _sse(first.model_dump_json())
                    first = None
                # Skip empty deltas: no text, no logprobs and no finish say nothing.
                said = [
                    c for c in output.outputs if c.text or c.logprobs or c.finish_reason is not None
                ]
                if said and (event := chunk(replace(output, outputs=said))) is not None:
                    yield _sse(event.model_dump_json())
            if include_usage:
                usage = chunk(output).model_copy(
                    update={"choices": [], "usage": UsageInfo.of(num_prompt, num_output)}
                )
                yield _sse(usage.model_dump_json())
        except Exception as e:  # the status line is sent: report the error in-band
            logger.warning("request %s failed mid-stream: %s", accepted.request_id, e)
            self.live.fail(accepted.request_id)
            _, body = error_from_exception(e)
            yield _sse(json.dumps(body))
        yield _sse("[DONE]")


def _chat_message(text: str, tool_choice) -> ChatResponseMessage:
    """The assistant's message: its text, or with a forced tool call the call(s) its
    constrained text spells (text again if ``max_tokens`` cut the call short)."""
    calls = parse_tool_calls(text, tool_choice) if tool_choice is not None else None
    if calls is None:
        return ChatResponseMessage(content=text)
    return ChatResponseMessage(
        content="",  # as vLLM sends it with tool_choice "required" or a named function
        tool_calls=[
            ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=args))
            for name, args in calls
        ],
    )


class _ToolCallDeltas:
    """A forced tool call, streamed. A named function: its arguments as they are
    generated (the first delta of a choice also carries the call's id and name).
    ``"required"``: the calls are whole only when the array closes, so each comes in
    one delta at the end; an output cut short by ``max_tokens`` comes as text."""

    def __init__(self, tool_choice) -> None:
        self.tool_choice = tool_choice
        self.text: dict[int, str] = {}  # per choice, everything so far

    def __call__(self, completion: CompletionOutput) -> DeltaMessage:
        index, delta = completion.index, completion.text
        first = index not in self.text
        self.text[index] = self.text.get(index, "") + delta
        if self.tool_choice != "required":
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))
            if first:
                call.id, call.type = new_tool_call_id(), "function"
                call.function.name = self.tool_choice.function.name
            return DeltaMessage(tool_calls=[call])
        if completion.finish_reason is None:
            return DeltaMessage()
        calls = parse_tool_calls(self.text[index], self.tool_choice)
        if calls is None:
            return DeltaMessage(content=self.text[index])
        return DeltaMessage(
            tool_calls=[
                DeltaToolCall(
                    index=i,
                    id=new_tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=name, arguments=args),
                )  # fmt: skip
                for i, (name, args) in enumerate(calls)
            ]
        )


def _single_prompt(prompt) -> str | list[int]:
    """One prompt: text or token ids. A batch in one request (a list of prompts) is not
    supported, except a list holding exactly one."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(
                f"a list of {len(prompt)} prompts in one request is not supported; "
                "send one request per prompt",
                "prompt",
            )
        prompt = prompt[0]
    if len(prompt) == 0:
        raise RequestError("prompt is empty", "prompt")
    return prompt


def _refuse_unless(supported: bool, field: str, hint: str = "") -> None:
    """For request fields declared only to refuse every value but the one that asks for
    nothing (``suffix: null``, ``best_of: 1``)."""
    if not supported:
        raise RequestError(f"{field} is not supported by minivllm{hint}", field)


def _text_content(content: str | list[TextContentPart] | None) -> str:
    """A message's text; content given as parts (all text: the protocol refuses others)
    is joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _usage(output: RequestOutput) -> UsageInfo:
    """The prompt once (the ``n`` choices share it), and every choice's tokens."""
    num_output = sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo.of(len(output.prompt_token_ids), num_output)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _chat_logprobs(completion: CompletionOutput, top: int) -> ChatCompletionLogProbs | None:
    if completion.logprobs is None:
        return None
    return chat_logprobs(completion.token_ids, completion.logprobs, top)


def _completion_response(
    accepted: Accepted, choices: list[CompletionChoice], usage: UsageInfo | None = None
) -> CompletionResponse:
    """The choices' text so far (a stream chunk) or in full (with ``usage``)."""
    return CompletionResponse(
        id=accepted.request_id,
        created=accepted.created,
        model=accepted.model,
        choices=choices,
        usage=usage,
    )
