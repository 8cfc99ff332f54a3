"""Seeded benchmark workloads: which prompts, how many output tokens, arriving when.

Every request asks for an exact number of output tokens (``ignore_eos`` + ``max_tokens``
in the runner), so every policy and every baseline does exactly the same work. Prompts
are random token ids by default (like vLLM's "random" dataset): their content does not
change the compute, their lengths do. The same seed always gives the same workload.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly: EOS is ignored
    arrival_time: float = 0.0  # seconds after the run starts


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_request_len(self) -> int:
        """The longest prompt + output: what a static server must reserve per request."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def describe(self) -> str:
        prompts = [len(r.prompt_token_ids) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        return (
            f"{self.name}: {len(self.requests)} requests, prompts {min(prompts)}-{max(prompts)} "
            f"tokens (mean {np.mean(prompts):.0f}), outputs {min(outputs)}-{max(outputs)} "
            f"tokens (mean {np.mean(outputs):.0f})"
        )

    def with_poisson_arrivals(self, request_rate: float, seed: int) -> Workload:
        """Arrivals of a Poisson process at ``request_rate`` requests/s; the first at t=0."""
        if request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {request_rate}")
        rng = np.random.default_rng([seed, 1])  # own stream: lengths don't depend on the rate
        gaps = rng.exponential(1.0 / request_rate, len(self.requests))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        requests = [replace(r, arrival_time=float(t)) for r, t in zip(self.requests, arrivals)]
        return Workload(f"{self.name}, Poisson {request_rate:g} req/s", requests)


@dataclass
class LengthDistribution:
    """A token-length distribution, written ``fixed:N``, ``uniform:LO:HI`` (inclusive) or
    ``lognormal:MEDIAN:SIGMA:LO:HI`` (clipped to [LO, HI]). A bare ``N`` means fixed."""

    kind: str
    args: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        kind, *rest = spec.split(":") if ":" in spec else ("fixed", spec)
        arity = {"fixed": 1, "uniform": 2, "lognormal": 4}
        try:
            args = tuple(float(a) for a in rest)
        except ValueError:
            args = ()
        # Lengths of at least one token; lognormal's SIGMA just positive. NaN fails both.
        lowest = [0 if kind == "lognormal" and i == 1 else 1 for i in range(len(args))]
        valid = len(args) == arity.get(kind) and all(
            low <= a < math.inf and a > 0 for a, low in zip(args, lowest)
        )
        if not valid:
            raise ValueError(
                f"bad length distribution {spec!r}; use N, fixed:N, uniform:LO:HI or "
                f"lognormal:MEDIAN:SIGMA:LO:HI with finite lengths >= 1 and SIGMA > 0"
            )
        return cls(kind, args)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.args[0])] * n
        if self.kind == "uniform":
            low, high = sorted(int(a) for a in self.args)
            return rng.integers(low, high + 1, n).tolist()
        median, sigma, low, high = self.args
        values = rng.lognormal(np.log(median), sigma, n)
        return np.clip(np.rint(values), low, high).astype(int).tolist()


def synthetic(
    num_requests: int,
    prompt_len: LengthDistribution,
    output_len: LengthDistribution,
    token_range: tuple[int, int],
    seed: int = 0,
) -> Workload:
    """Random prompts with lengths from ``prompt_len``, outputs from ``output_len``.
    ``token_range`` is [low, high) of the ids to draw (skip the special tokens)."""
    rng = np.random.default_rng(seed)
    prompt_lens = prompt_len.sample(rng, num_requests)
    output_lens = output_len.sample(rng, num_requests)
    requests = [
        BenchRequest(str(i), rng.integers(*token_range, p).tolist(), o)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens))
    ]
    return Workload("synthetic", requests)


def shared_system_prompt(
    num_requests: int,
    system_prompt_len: int,
    prompt_len: LengthDistribution,
    output_len: LengthDistribution,
    token_range: tuple[int, int],
    seed: int = 0,
) -> Workload:
    """Like `synthetic`, but every prompt starts with the same ``system_prompt_len`` tokens
    (a chat system prompt): the case prefix caching is for."""
    rng = np.random.default_rng([seed, 2])
    system = rng.integers(*token_range, system_prompt_len).tolist()
    user = synthetic(num_requests, prompt_len, output_len, token_range, seed)
    for request in user.requests:
        request.prompt_token_ids = system + request.prompt_token_ids
    return Workload(f"shared system prompt ({system_prompt_len} tokens)", user.requests)


def from_jsonl(
    path: str | Path,
    tokenize: Callable[[str], list[int]],
    output_len: LengthDistribution,
    seed: int = 0,
    num_requests: int | None = None,
) -> Workload:
    """One request per line: ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with
    an optional ``"max_tokens"``; lines without it draw their length from ``output_len``."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    lines = lines[:num_requests] if num_requests else lines
    drawn = output_len.sample(np.random.default_rng(seed), len(lines))
    requests = []
    for i, (line, default_len) in enumerate(zip(lines, drawn)):
        record = json.loads(line)
        if "prompt_token_ids" in record:
            ids = list(record["prompt_token_ids"])
        elif "prompt" in record:
            ids = tokenize(record["prompt"])
        else:
            raise ValueError(f"{path}:{i + 1}: needs 'prompt' or 'prompt_token_ids'")
        requests.append(BenchRequest(str(i), ids, int(record.get("max_tokens", default_len))))
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return Workload(f"file {Path(path).name}", requests)


def length_distribution(spec: str) -> LengthDistribution:
    """An argparse type: ``N``, ``uniform:LO:HI`` or ``lognormal:...`` (bench's and
    simulate's length flags)."""
    try:
        return LengthDistribution.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
