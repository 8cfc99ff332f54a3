"""How many draft tokens the target model would accept, for a simulation without one.

With ``speculative_config``, the real scheduler and its n-gram proposer run unchanged in
the simulator and draft tokens for every decode (the simulated outputs are placeholders,
so the proposer always finds a match: every decode carries ``k`` drafts, as on
copy-heavy traffic). What no cost model can know is which drafts the model would keep.
An `AcceptanceProfile` says it the way vLLM reports it: for each draft position ``i``,
the fraction of verifications whose first ``i + 1`` drafts were all accepted
(``spec_decode_acceptance_rate_per_pos``). Each verification draws one uniform number
``u`` and accepts the drafts at the positions whose rate exceeds ``u``: over many
draws, position ``i`` is accepted at exactly its rate, and never after a rejection.

The presets are the real engine's measured n-gram acceptance (SmolLM2-135M-Instruct,
greedy, 3 drafts, `benchmarks/spec_decode.py`, run 1 of the chapter on speculative
decoding, at 64 requests per batch): ``copy-heavy`` prompts that ask to repeat or
reformat a passage, and ``no-copy`` prompts (poems, tips, explanations) whose answers
quote nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# docs/assets/results/spec-decode-2026-12-01-run1.json, max_num_seqs 64.
MEASURED = {
    "copy-heavy": (0.982, 0.954, 0.922),
    "no-copy": (0.604, 0.420, 0.278),
}
DEFAULT = "no-copy"  # chat traffic is closer to plain prompts than to copying


@dataclass(frozen=True)
class AcceptanceProfile:
    name: str
    rate_per_pos: tuple[float, ...]  # non-increasing, each in [0, 1]

    def __post_init__(self) -> None:
        rates = self.rate_per_pos
        if not rates or any(not 0 <= r <= 1 for r in rates):
            raise ValueError(f"acceptance rates must be in [0, 1], got {list(rates)}")
        if any(later > earlier for earlier, later in zip(rates, rates[1:])):
            raise ValueError(
                f"acceptance rates per position must not increase (position i + 1 needs "
                f"position i accepted), got {list(rates)}"
            )

    @classmethod
    def parse(cls, text: str) -> AcceptanceProfile:
        """A preset name (``copy-heavy``, ``no-copy``); one rate ``a``: each draft kept
        with probability ``a`` once the ones before it were (rates ``a, a^2, ...``); or
        comma-separated rates per position."""
        if text in MEASURED:
            return cls(text, MEASURED[text])
        try:
            rates = tuple(float(part) for part in text.split(","))
        except ValueError:
            raise ValueError(
                f"bad acceptance rate {text!r}: give {', '.join(MEASURED)}, a rate in "
                "[0, 1], or comma-separated rates per draft position"
            ) from None
        if len(rates) == 1:
            return cls.geometric(rates[0])
        return cls(text, rates)

    @classmethod
    def geometric(cls, rate: float) -> AcceptanceProfile:
        """Every draft accepted with probability ``rate`` given the ones before it."""
        if not 0 <= rate <= 1:
            raise ValueError(f"acceptance rates must be in [0, 1], got {rate}")
        return cls(f"{rate:g} per draft", (rate,))

    def rate_at(self, position: int) -> float:
        """Position ``position``'s rate; past the given positions, each further draft is
        kept with the last given ratio between neighbours (a single rate ``a``: ``a``)."""
        rates = self.rate_per_pos
        if position < len(rates):
            return rates[position]
        ratio = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[-1]
        return rates[-1] * ratio ** (position - len(rates) + 1)

    def num_accepted(self, num_drafts: int, rng: random.Random) -> int:
        """Drafts kept, of ``num_drafts``: those at the positions whose rate beats one
        uniform draw (so the kept ones are always a prefix)."""
        u = rng.random()
        return sum(1 for position in range(num_drafts) if u < self.rate_at(position))
