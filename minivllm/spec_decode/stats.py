"""How well the drafts did, counted like vLLM's ``SpecDecodingStats``.

A *draft* is one request's drafts verified in one step (so ``num_drafts`` counts
verification events, not steps or requests). Position ``i`` counts as accepted only if
every draft before it was accepted too, so ``num_accepted_tokens_per_pos`` falls with
``i``. vLLM exports the four counters as ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}``; the rates are derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k: the most drafts a request gets per step
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request verified ``num_draft_tokens`` drafts and kept the first
        ``num_accepted_tokens`` of them."""
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        """A snapshot that later counting leaves alone."""
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def __sub__(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted since the snapshot ``earlier`` (e.g. after a warm-up)."""
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [
                a - b
                for a, b in zip(
                    self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos
                )
            ],  # fmt: skip
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step emits on average, the bonus / corrected one
        included (vLLM's convention): ``1 + accepted / drafts``."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """For each draft position: how often a draft reached it and was accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0
                for n in self.num_accepted_tokens_per_pos]  # fmt: skip

    def as_dict(self) -> dict:
        """The counters under vLLM's metric names (without the ``vllm:`` prefix), and
        the derived rates."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }

    def log_line(self) -> str:
        """vLLM's "SpecDecoding metrics" log line; with no draft yet, a line that says so
        (a mean acceptance length of 0.00 would be no measurement, shown as one)."""
        if not self.num_drafts:
            return (
                "SpecDecoding metrics: no drafts proposed yet (no n-gram of a request "
                "matched its earlier tokens), Drafted: 0 tokens"
            )
        per_pos = ", ".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} "
            f"tokens, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
        )
