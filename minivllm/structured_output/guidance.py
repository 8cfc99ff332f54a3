"""The llguidance backend (vLLM's "guidance" backend): JSON schema, regex, choice and
Lark/GBNF grammars over one tokenizer.

llguidance (a Rust library, a small wheel with no dependencies) walks the grammar
lazily, token trie against an Earley parser, so there is no ahead-of-time automaton to
build: compiling a grammar takes milliseconds, and the mask of one step about 0.1 ms for
SmolLM2's 49,152 tokens. Its matcher can accept, validate and roll back tokens, which is
what speculative decoding needs.

JSON is compiled without free whitespace between tokens (``whitespace_flexible=False``,
vLLM's ``disable_any_whitespace``): a small model given the choice often emits newlines
forever. The separators are ``", "`` and ``": "``, as ``json.dumps`` writes them.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from minivllm.sampling_params import StructuredOutputsParams

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not checked yet)."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    try:  # Lark, or GBNF (llama.cpp's) converted to Lark
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar is not a valid grammar: {e}") from None


class GuidanceGrammar:
    """One request's `llguidance.LLMatcher`."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self.matcher.validate_tokens(token_ids) < len(token_ids):
            return False  # refused before the matcher enters its error state
        return self.matcher.consume_tokens(token_ids)

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GuidanceCompiled:
    """A compiled matcher at the start of its grammar; each request gets a deep copy
    (microseconds), so a schema seen before costs no compile at all."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def new_matcher(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.matcher.deep_copy())


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the field if the constraint does not compile. Needs no
    tokenizer (about a millisecond), so it runs when the request is added."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    if error:
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {error}")


class GuidanceBackend:
    """``tokenizer``: the engine's Hugging Face tokenizer (a fast one: llguidance reads its
    Rust core); ``vocab_size``: the model's, the width of the logits (a model may have
    more rows than its tokenizer has tokens: those are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # About 1 s for SmolLM2's tokenizer: built once, on the compile thread.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    validate = staticmethod(validate)

    def compile(self, params: StructuredOutputsParams) -> GuidanceCompiled:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}"
            )
        return GuidanceCompiled(matcher)
