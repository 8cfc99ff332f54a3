"""The OpenAI API's request and response bodies, as pydantic models (vLLM's protocol.py).

Only the fields minivllm implements are declared, and a request with any other field is
refused (400 naming it): nothing is accepted and then silently ignored. (Current vLLM
accepts unknown fields with a warning in its log, which a client never sees.) The only
fields accepted without effect are the ones that cannot change the tokens: ``user``,
``metadata``, ``store``, ``service_tier``, ``safety_identifier`` and the prompt-cache
hints. Field types are checked by pydantic (a wrong type is a 400 naming the field);
value ranges by `SamplingParams`, so the rules live in one place. Every string must be
encodable as UTF-8 (JSON allows a lone surrogate such as ``"\\ud800"``; a tokenizer
does not).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from minivllm.sampling_params import (
    MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body (or a part of one): an undeclared field is refused."""

    model_config = ConfigDict(extra="forbid")


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text has a character that cannot be encoded as UTF-8 at index {e.start} "
            "(a lone UTF-16 surrogate?)"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


# --- errors ---------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status, as vLLM sends it


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- requests -------------------------------------------------------------------------------


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIRequestModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema: read under an alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequestModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (JSON valid under ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIRequestModel):
    """vLLM's ``structured_outputs`` extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_outputs_from(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsField | None
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, checked (does it compile?) before any work;
    ValueError naming the field otherwise."""
    from minivllm.structured_output import validate_structured_outputs

    asked = response_format is not None and response_format.type != "text"
    if asked and structured_outputs is not None:
        raise ValueError(
            "response_format and structured_outputs both ask for a constraint; send one"
        )
    if asked:
        field = "response_format"
        if response_format.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif response_format.json_schema is None or response_format.json_schema.json_schema is None:
            raise ValueError(
                "response_format of type json_schema needs json_schema.schema, the JSON schema"
            )
        else:
            params = StructuredOutputsParams(json=response_format.json_schema.json_schema)
    elif structured_outputs is not None:
        field = "structured_outputs"
        try:
            params = StructuredOutputsParams(
                **structured_outputs.model_dump(by_alias=True, exclude_none=True)
            )
        except ValueError as e:
            raise ValueError(_naming(field, str(e))) from None
    else:
        return None
    try:
        validate_structured_outputs(params)
    except ValueError as e:
        raise ValueError(_naming(field, str(e))) from None
    return params


def _naming(field: str, message: str) -> str:
    """ "structured_outputs.json does not compile: ..." -> "<field> (json) does not
    compile: ...": the message starts with the request field, which the error's
    ``param`` takes (errors.py)."""
    first, _, rest = message.partition(" ")
    if first.startswith("structured_outputs."):
        return f"{field} ({first.split('.', 1)[1]}) {rest}"
    return message


class SamplingFields(OpenAIRequestModel):
    """What completions and chat requests share."""

    model: Text | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extra; 0 or -1 = off
    min_p: float = 0.0  # vLLM extra
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extra
    # JSON keys are strings: token ids given as "50256" are read as ints.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM extra
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    include_stop_str_in_output: bool = False  # vLLM extra
    skip_special_tokens: bool = True  # vLLM extra
    ignore_eos: bool = False  # vLLM extra
    min_tokens: int = 0  # vLLM extra
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extra: each prompt token's logprob and the top ones there (0 .. MAX_LOGPROBS),
    # sent back as ``prompt_logprobs`` (completions: in each choice; chat: in the response,
    # as vLLM does); not in a stream (vLLM refuses that too).
    prompt_logprobs: int | None = None
    # vLLM extras: beam search. ``n`` beams are kept and come back as the choices, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs extra.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # Accepted, no effect on the tokens: who asks, and hints for OpenAI's own services.
    user: str | None = None

    # Fields that only sampling reads: beam search refuses them rather than ignore them.
    BEAM_SEARCH_REFUSES: ClassVar[tuple[str, ...]] = (
        "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "logit_bias", "allowed_token_ids", "stop", "stop_token_ids",
        "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
        "response_format", "structured_outputs", "tools", "tool_choice",
    )  # fmt: skip

    def engine_params(
        self, max_tokens: int | None, max_model_len: int
    ) -> SamplingParams | BeamSearchParams:
        """What the engine is asked for: sampling, or with ``use_beam_search`` a beam
        search (vLLM's ``to_beam_search_params``: ``n`` is the beam width; no
        ``max_tokens`` means as many as the context leaves, which the engine caps)."""
        if self.stream_options is not None and not self.stream:  # vLLM refuses it too
            raise ValueError("stream_options can only be given with stream: true")
        if not self.use_beam_search:
            return self.sampling_params(max_tokens)
        if not 1 <= self.n <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"n must be in [1, {MAX_LOGPROBS // 2}] with use_beam_search (the beam width: "
                f"each beam asks for 2 * n logprobs, at most {MAX_LOGPROBS}), got {self.n}"
            )
        fields = type(self).model_fields
        for name in self.BEAM_SEARCH_REFUSES:
            if name in fields and getattr(self, name) != fields[name].default:
                raise ValueError(
                    f"{name} is not used by beam search (use_beam_search: true); leave it out"
                )
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_model_len if max_tokens is None else max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def structured_output_params(self) -> StructuredOutputsParams | None:
        return structured_outputs_from(self.response_format, self.structured_outputs)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field (its first word) for a bad value."""
        check_num_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs are not available with stream: true (as in vLLM); "
                "ask for them without streaming"
            )
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_output_params(),
            # Streams get each step's new text; a plain response only the final result.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


def check_num_logprobs(name: str, value: int | None) -> None:
    """How many top logprobs a request may ask for: 0 .. MAX_LOGPROBS (vLLM's default
    ``max_logprobs``). vLLM reads -1 as "the whole vocabulary" where its server was
    started with ``--max-logprobs -1``; with the default it refuses that too, so -1 gets
    a 400 here, saying why."""
    if value is None or 0 <= value <= MAX_LOGPROBS:
        return
    whole = " (-1, every token of the vocabulary, is not served)" if value == -1 else ""
    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}{whole}")


class CompletionRequest(SamplingFields):
    # Text, or token ids (what `vllm bench serve` and `minivllm bench --base-url` send).
    # A list of several prompts (a batch in one request) is not supported.
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    # ``echo``: the prompt comes back before the completion (with ``logprobs``, its
    # tokens' too); then ``max_tokens: 0`` asks for the prompt alone, as lm-eval does.
    echo: bool = False
    logprobs: int | None = None  # the top ones per token: 0 .. MAX_LOGPROBS
    # Declared to be refused with a clear message unless they ask for nothing.
    suffix: str | None = None
    best_of: int | None = None  # only 1 (= n): one sample, best of one

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        check_num_logprobs("logprobs", self.logprobs)
        # ``echo`` + ``logprobs`` needs the prompt's rows too: ``prompt_logprobs`` of the
        # top ones there if given (as in vLLM), else ``logprobs``.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return replace(
            super().sampling_params(max_tokens),
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class TextContentPart(OpenAIRequestModel):
    """The one content part a text-only model reads (images, audio, files are refused)."""

    type: Literal["text"]
    text: Text


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequestModel):
    role: Text
    content: Text | list[TextContentPart] | None = None
    # A conversation that went through tool calls: the assistant's calls, a tool's answer.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(OpenAIRequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatTool(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIRequestModel):
    name: str


class NamedToolChoice(OpenAIRequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None  # the deprecated alias
    logprobs: bool = False
    top_logprobs: int | None = None  # needs ``logprobs: true``; 0 .. MAX_LOGPROBS
    # Accepted, no effect on the tokens: who asks, and hints for OpenAI's own services.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Tool calling without a parser: "required" or a named function constrains the output
    # to the call's JSON (tool_calls.py); "auto" needs a model-specific parser (refused).
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        from minivllm.entrypoints.openai.tool_calls import tool_call_constraint

        constraint = tool_call_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        if constraint is None:
            return super().structured_output_params()
        if self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text"
        ):
            raise ValueError(
                "tool_choice constrains the output to a tool call; response_format or "
                "structured_outputs cannot constrain it too"
            )
        return constraint

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        check_num_logprobs("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return replace(super().sampling_params(max_tokens), logprobs=logprobs)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeCompletionRequest(OpenAIRequestModel):
    """``POST /tokenize`` with a text: the ids the completions route would give it."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True  # as the completions route tokenizes (a BOS, if any)
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequestModel):
    """``POST /tokenize`` with messages: the ids the chat route would give them."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIRequestModel):
    model: Text | None = None
    tokens: list[int]


# --- responses ------------------------------------------------------------------------------


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def _now() -> int:
    return int(time.time())


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's legacy completions logprobs: per token its text, its logprob, the top
    ones by text, and where its text starts in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob, its rank in the
    vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs`` in a response: per prompt token, token id -> its entry (the
# prompt's token and the top ones); the first is null, nothing predicts it. JSON keys are
# strings: "42".
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # vLLM sends [] when none


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's text in UTF-8


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # The templated prompt's, once for all the choices (vLLM's place for them in chat).
    prompt_logprobs: PromptLogprobsJSON | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of a tool call: the first of a call has its id, type and name;
    the others add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
