"""Speculative decoding inside the continuous batch (vLLM v1's design, n-gram drafts only).

A decoding request may bring *draft tokens*: guesses for its next few tokens, proposed
for free by looking its own recent tokens up earlier in its prompt and output
(`NgramProposer`). The scheduler schedules the request for ``1 + num_drafts`` tokens out of
the same token budget, the model computes them in the same flattened batch as everyone
else (a decode with drafts is a tiny prefill chunk), and the `RejectionSampler` keeps the
drafts the target model agrees with, plus one token of its own. Rejected drafts cost
nothing but the compute: ``num_computed_tokens`` moves back and their blocks return.
"""

from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.rejection_sampler import RejectionSampler
from minivllm.spec_decode.stats import SpecDecodingStats

__all__ = ["NgramProposer", "RejectionSampler", "SpecDecodingStats"]
