"""Turn each sampled row of logits into one token id.

Greedy rows take the argmax. Other rows apply temperature, then top-k, top-p and min-p
filters, then draw with the *exponential race*: ``argmax(probs / E)`` with ``E ~ Exp(1)``
picks index ``i`` with probability ``probs[i]``. The noise ``E`` comes from each request's
own generator, so a seeded request draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

import torch

from minivllm.scheduler_output import ScheduledChunk
from minivllm.sequence import Sequence


class Sampler:
    """``eos_token_ids``: masked, with each request's stop token ids, until the request
    has ``min_tokens`` outputs (vLLM's min-tokens logits processor)."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledChunk | Sequence]) -> list[int]:
        """logits ``[num_seqs, vocab_size]``, one row per request that samples now; each
        row's ``sampling_params``, ``generator`` and ``num_output_tokens`` (so far)."""
        logits = self._mask_stops_before_min_tokens(logits.float(), seqs)
        greedy_tokens = logits.argmax(dim=-1)
        params = [seq.sampling_params for seq in seqs]
        if all(p.greedy for p in params):
            return greedy_tokens.tolist()

        temperatures = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params], device=logits.device
        )
        logits = logits / temperatures[:, None]
        if any(p.top_k > 0 for p in params):
            logits = _apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1 for p in params):
            logits = _apply_top_p(logits, [p.top_p for p in params])
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=probs.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0)

        noise = torch.empty_like(probs)
        for row, seq in enumerate(seqs):
            noise[row].exponential_(generator=seq.generator)
        sampled_tokens = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy_tokens, sampled_tokens).tolist()

    def _mask_stops_before_min_tokens(
        self, logits: torch.Tensor, seqs: list[ScheduledChunk | Sequence]
    ) -> torch.Tensor:
        """EOS (unless ignored) and stop token ids get probability 0 in each row whose
        request has fewer than ``min_tokens`` outputs."""
        vocab_size = logits.shape[-1]
        banned_per_row = {}
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            if seq.num_output_tokens < params.min_tokens:
                stops = set(params.stop_token_ids) | (
                    set() if params.ignore_eos else self.eos_token_ids
                )
                banned_per_row[row] = [t for t in stops if t < vocab_size]
        if not any(banned_per_row.values()):
            return logits
        logits = logits.clone()  # the caller's tensor stays as the model made it
        for row, banned in banned_per_row.items():
            logits[row, banned] = float("-inf")
        return logits


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (``k=0``: keep all)."""
    vocab_size = logits.shape[-1]
    ks = torch.tensor(
        [k if 0 < k < vocab_size else vocab_size for k in top_ks], device=logits.device
    )
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_largest = sorted_logits.gather(-1, (ks - 1)[:, None])
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to ``p``."""
    top_p = torch.tensor(top_ps, device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token if the tokens before it already reach p; the first one always stays.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
