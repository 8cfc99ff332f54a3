"""Chat-like workloads for the simulator: lognormal prompt and output lengths.

Real chat traffic has a long tail: most answers are short, a few are very long. The vLLM
paper's ShareGPT workload averages about 161 prompt and 338 output tokens, Alpaca about
19 and 58. A lognormal with median ``m`` and shape ``sigma`` has mean
``m * exp(sigma**2 / 2)``; the presets below pick medians that give those means before
clipping (``describe()`` prints the means actually drawn). The requests themselves are
`minivllm.bench.workloads` ones, so everything bench does with a workload works here.
"""

from __future__ import annotations

import math

from minivllm.bench.workloads import LengthDistribution, Workload, synthetic

# Prompt token ids are drawn from a small range: their values change nothing in a
# simulation, and Python shares one object per small int, so 100,000 prompts stay small.
TOKEN_RANGE = (3, 256)


def lognormal_with_mean(mean: float, sigma: float, low: int, high: int) -> LengthDistribution:
    """A clipped lognormal whose unclipped mean is ``mean``."""
    median = mean / math.exp(sigma**2 / 2)
    return LengthDistribution("lognormal", (median, sigma, low, high))


CHAT_LENGTHS: dict[str, tuple[LengthDistribution, LengthDistribution]] = {
    "sharegpt": (lognormal_with_mean(161, 1.0, 4, 4096), lognormal_with_mean(338, 1.0, 4, 4096)),
    "alpaca": (lognormal_with_mean(19, 0.6, 2, 512), lognormal_with_mean(58, 0.6, 2, 1024)),
}


def chat_workload(
    num_requests: int,
    lengths: str = "sharegpt",
    request_rate: float = math.inf,
    seed: int = 0,
    prompt_len: LengthDistribution | None = None,
    output_len: LengthDistribution | None = None,
) -> Workload:
    """``num_requests`` requests with ``lengths``-like lengths (or the given
    distributions), arriving as a Poisson process at ``request_rate`` (inf: all at t=0)."""
    if lengths not in CHAT_LENGTHS:
        raise ValueError(
            f"unknown length preset {lengths!r}; choose from {', '.join(CHAT_LENGTHS)}"
        )
    default_prompt, default_output = CHAT_LENGTHS[lengths]
    workload = synthetic(
        num_requests,
        prompt_len or default_prompt,
        output_len or default_output,
        TOKEN_RANGE,
        seed,
    )
    workload.name = f"{lengths}-like" if prompt_len is None and output_len is None else "custom"
    if math.isfinite(request_rate):
        workload = workload.with_poisson_arrivals(request_rate, seed)
    return workload
