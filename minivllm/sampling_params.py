"""How one request wants its tokens chosen and when it should stop (mirrors vLLM's)."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from minivllm.utils import as_int

# Below this temperature a request is greedy (vLLM's ``_SAMPLING_EPS``): dividing logits
# by a tinier one overflows float32 to inf, and softmax then returns NaN.
SAMPLING_EPS = 1e-5
# What torch.Generator.manual_seed accepts: any 64-bit value, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` reports for a request that made progress."""

    CUMULATIVE = 0  # everything generated so far (vLLM's default)
    DELTA = 1  # only what is new since the last report: for streaming
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """Sampling and stopping settings for one request.

    ``n``: how many completions of the prompt to return (parallel sampling; child ``i``
    samples with ``seed + i`` when a seed is given). ``temperature=0`` (anything below
    ``SAMPLING_EPS``) means greedy. ``top_k=0`` (or -1),
    ``top_p=1`` and ``min_p=0`` switch those filters off. ``seed`` makes this request's
    random choices reproducible whatever else shares its batch. ``min_tokens``: no stop
    (EOS, stop ids, stop strings) before that many tokens; EOS and stop ids are not even
    sampled. Invalid values raise
    ValueError at construction; integer fields accept numpy and torch integers too.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list | tuple | None):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = [as_int("stop_token_ids", t) for t in self.stop_token_ids or []]
        self.n, self.top_k, self.min_tokens = (
            as_int(name, getattr(self, name)) for name in ("n", "top_k", "min_tokens")
        )
        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens)
        if self.seed is not None:
            self.seed = as_int("seed", self.seed)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 or -1 (disabled) or a positive int, got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.seed is not None and self.seed + self.n - 1 > SEED_RANGE[1]:
            # child i of an n > 1 request samples with seed + i (parallel_sampling.py)
            raise ValueError(f"seed + n - 1 must fit in 64 bits, got seed={self.seed}, n={self.n}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
