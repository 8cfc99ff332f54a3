"""Draft tokens by prompt lookup: the request's own tokens predict its next ones.

When an answer copies from its prompt (or from itself), the last few tokens it produced
usually appeared before, and what followed them then is a good guess for what follows
now. For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: take the last
``n`` tokens, find their earliest earlier occurrence, propose the (up to) ``k`` tokens
after it. The longest ``n`` that matches wins. Like vLLM's proposer, and the original
prompt-lookup decoding, ties go to the *earliest* occurrence.

No model runs: a draft costs a search over the request's tokens on the CPU, nothing else.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_num_tokens)`` draft tokens to follow ``token_ids``; maybe none.

        >>> NgramProposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3])
        [4, 2, 3]

        (the 3-gram ``[4, 2, 3]`` never occurred before; the 2-gram ``[2, 3]`` did, at
        index 1, and only three tokens follow it)."""
        k = self.k if max_num_tokens is None else min(self.k, max_num_tokens)
        if k < 1:
            return []
        tokens = np.asarray(token_ids)
        # An n-gram needs an earlier occurrence, so n < len(tokens): none if len <= min_n.
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._earliest_match(tokens, n)
            if start is not None:
                return tokens[start + n : start + n + k].tolist()
        return []

    @staticmethod
    def _earliest_match(tokens: np.ndarray, n: int) -> int | None:
        """Index of the first occurrence of the last ``n`` tokens that is followed by at
        least one token (so not the suffix itself), or None."""
        windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]: every earlier n-gram
        matches = (windows == tokens[-n:]).all(axis=1)
        return int(matches.argmax()) if matches.any() else None
