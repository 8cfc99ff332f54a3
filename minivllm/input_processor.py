"""From a user's prompt to a `Sequence` the scheduler can take (vLLM's ``Processor``).

Tokenizes text prompts and checks everything that could fail later: an empty prompt,
ids outside the vocabulary, a prompt longer than ``max_model_len`` or than the whole KV
cache. A bad request raises ValueError here, before anything is queued.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from minivllm.utils import as_int, cdiv

# Text, or like vLLM's TextPrompt {"prompt": "text"} or TokensPrompt {"prompt_token_ids": [...]}
Prompt = str | dict


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.device = device
        self._seed_rng = random.Random(seed)  # seeds requests that bring no seed

    def process(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None, arrival_time: float
    ) -> Sequence:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.check_token_ids(self.vocab_size)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return Sequence(request_id, token_ids, params, text, arrival_time, generator)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = prompt["prompt"]  # vLLM's TextPrompt: {"prompt": "text"}
            if not isinstance(prompt, str):
                raise ValueError(f"a TextPrompt's prompt must be a str, got {prompt!r}"[:200])
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), self._as_token_ids(prompt["prompt_token_ids"])
        raise ValueError(
            "a prompt must be a str, {'prompt': str} or {'prompt_token_ids': [...]}, got "
            f"{type(prompt).__name__}"
        )

    @staticmethod
    def _as_token_ids(token_ids) -> list[int]:
        """Plain ints from a list, array or tensor of Python, numpy or torch integers."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {token_ids!r}")
        # The usual cases, checked once rather than with a Python call per token: a list of
        # plain ints (``type`` is exact: a bool is not a token id), or an integer array.
        if isinstance(token_ids, list) and set(map(type, token_ids)) <= {int}:
            return list(token_ids)
        dtype = getattr(token_ids, "dtype", None)
        if dtype is not None and getattr(token_ids, "ndim", None) == 1 and _is_integer(dtype):
            return token_ids.tolist()
        ids, bad = [], []
        for token in token_ids:
            try:
                ids.append(as_int("a prompt token id", token))
            except ValueError:
                bad.append(token)
        if bad:
            raise ValueError(f"prompt token ids must be ints, got {bad[:5]}")
        return ids

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:  # in C, not per token
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        # The pool first: when max_model_len is the cache's capacity (the default), this
        # names the real limit, blocks needed against blocks in the pool.
        blocks_needed = cdiv(len(token_ids), self.block_size)
        if blocks_needed > self.num_kv_blocks:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens and needs {blocks_needed} KV blocks of "
                f"{self.block_size} tokens, but the cache has only "
                f"num_kv_blocks={self.num_kv_blocks}"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}"
            )


def _is_integer(dtype) -> bool:
    """A numpy or torch integer dtype (not bool)."""
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype is not torch.bool
    return np.issubdtype(dtype, np.integer)
