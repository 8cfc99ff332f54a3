"""Incremental detokenization and stop strings, on vLLM's rules.

``output_text`` only grows, one token at a time (it is cut once, at a stop string):
each new token's text is the decode of a short window of tokens ending at it, minus the
decode of the same window without it. The window gives a token its context (a leading
space, the rest of a multi-byte character) without re-decoding the whole output. While
the text ends mid-character (a byte-level tokenizer splits a CJK character or an emoji
over several tokens, and decoding the first part gives U+FFFD), nothing is added: the
character arrives whole with the token that completes it.

Stop strings are searched only in that completed text, and only where a match can end
in text the last token added (it may start earlier). Text made before ``min_tokens``
tokens is never searched. The search does not walk the list of stop strings: at each new
character it looks the text ending there up in a set, once per distinct stop-string
length, so its cost per token does not grow with the number of stop strings.

Streaming holds back the last ``len(longest stop) - 1`` characters while stop strings
are active: they may turn out to be the start of a stop string, which must never reach
the user.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams

INCOMPLETE = "\ufffd"  # what decoding gives for the bytes of an unfinished character


class Detokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.token_ids: list[int] = []  # the tokens whose text counts
        self.num_output_tokens = 0  # all of them, a stop token's too
        self.stop_string: str | None = None  # the stop string that fired, if any
        # Decoding window: tokens [prefix_offset, read_offset) are already in output_text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop_check_offset = 0  # a stop string must end after this character
        # Each stop string's place in the list (the first wins a tie) and their lengths.
        self._stop_rank = {stop: rank for rank, stop in reversed(list(enumerate(params.stop)))}
        self._stop_lengths = sorted({len(stop) for stop in params.stop})
        self._hold_back = (
            max(map(len, params.stop)) - 1
            if params.stop and not params.include_stop_str_in_output
            else 0
        )
        self._num_streamed_chars = 0  # for RequestOutputKind.DELTA
        self._num_streamed_tokens = 0
        # A fast tokenizer's Rust core is called directly: transformers' Python wrapper
        # around it costs three times the decode itself, twice per output token. (Same
        # text: the wrapper adds only the clean-up of spaces, used when it is switched on.)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            backend = None
        self._backend_decode = backend.decode if backend is not None else None

    def update(self, token_id: int, stopped_by_token: bool) -> str | None:
        """Add one output token; returns the stop string it completed, if any (then
        ``output_text`` ends at it, or just after it with ``include_stop_str_in_output``).

        ``stopped_by_token``: the token is EOS or a stop token id that ends the request;
        as in vLLM its text is left out unless ``include_stop_str_in_output``."""
        self.num_output_tokens += 1
        if self.tokenizer is None:
            return None
        if stopped_by_token and not self.params.include_stop_str_in_output:
            return None
        self.token_ids.append(token_id)
        self.output_text += self._decode_next()
        if self.num_output_tokens <= self.params.min_tokens or stopped_by_token:
            self._stop_check_offset = len(self.output_text)
            return None
        return self._find_stop_string()

    def _decode(self, token_ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=skip)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip)

    def _decode_next(self) -> str:
        """The text the newest token completes ("" while a character is unfinished)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _find_stop_string(self) -> str | None:
        text, num_new_chars = self.output_text, len(self.output_text) - self._stop_check_offset
        self._stop_check_offset = len(text)
        if num_new_chars == 0 or not self._stop_rank:
            return None
        include = self.params.include_stop_str_in_output
        best: tuple[int, int, str] | None = None  # (where the text is cut, rank, stop)
        for end in range(len(text) - num_new_chars + 1, len(text) + 1):
            for length in self._stop_lengths:  # every match that ends at `end`
                if length > end:
                    break
                stop = text[end - length : end]
                rank = self._stop_rank.get(stop)
                if rank is None:
                    continue
                candidate = (end if include else end - length, rank, stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        cut, _, self.stop_string = best
        self.output_text = text[:cut]
        return self.stop_string

    def finish(self) -> str | None:
        """The request ends: add what an unfinished last character held back (as U+FFFD,
        like a plain decode) and return the stop string that text completes, if any (or
        the one that already fired)."""
        if self.tokenizer is None or self.stop_string is not None:
            return self.stop_string
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        self.output_text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        if self.num_output_tokens <= self.params.min_tokens:
            return None
        return self._find_stop_string()

    def text_to_show(self, finished: bool) -> str:
        """All the text the user may see now: not the held-back tail until the end."""
        if finished or not self._hold_back:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self._hold_back)]

    def take_delta(
        self, token_ids: list[int], num_prompt_tokens: int, finished: bool
    ) -> tuple[str, list[int]]:
        """Text and output token ids not yet streamed (for ``RequestOutputKind.DELTA``), from
        the request's ``token_ids`` (prompt first): only the new ones are read."""
        text = self.text_to_show(finished)
        # A stop string never cuts into streamed text: the hold-back is long enough.
        delta_text = text[self._num_streamed_chars :]
        delta_ids = token_ids[num_prompt_tokens + self._num_streamed_tokens :]
        self._num_streamed_chars = max(self._num_streamed_chars, len(text))
        self._num_streamed_tokens = len(token_ids) - num_prompt_tokens
        return delta_text, delta_ids

    def has_unstreamed_tokens(self, num_output_tokens: int) -> bool:
        return num_output_tokens > self._num_streamed_tokens
