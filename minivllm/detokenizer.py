"""Incremental detokenization and stop strings.

Text is re-decoded from all output tokens each time (cheap at these lengths, and always
exactly ``tokenizer.decode(token_ids)``). A trailing U+FFFD means the last token ended
mid-character, so streaming holds those characters back until the next token completes
them.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams


class Detokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.text = ""
        self.num_streamed_chars = 0  # how much of `text` DELTA outputs already sent
        self.num_streamed_tokens = 0

    def update(self, output_token_ids: list[int]) -> str | None:
        """Decode the outputs so far; returns the stop string that fired, if any, and then
        ``text`` ends at it (or just after it, with ``include_stop_str_in_output``)."""
        if self.tokenizer is None:
            return None
        previous_len = len(self.text)
        self.text = self.tokenizer.decode(
            output_token_ids, skip_special_tokens=self.params.skip_special_tokens
        )
        return self._find_stop_string(previous_len)

    def _find_stop_string(self, previous_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            # Only text that is new (plus an overlap the stop could straddle) can match.
            at = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        return stop

    def stable_text(self, finished: bool) -> str:
        """The text safe to show: without a trailing incomplete character unless done."""
        return self.text if finished else self.text.rstrip("\ufffd")

    def take_delta(self, output_token_ids: list[int], finished: bool) -> tuple[str, list[int]]:
        """Text and token ids not yet streamed (for ``RequestOutputKind.DELTA``)."""
        text = self.stable_text(finished)
        delta_text = text[self.num_streamed_chars :]
        delta_ids = output_token_ids[self.num_streamed_tokens :]
        self.num_streamed_chars, self.num_streamed_tokens = len(text), len(output_token_ids)
        return delta_text, delta_ids
