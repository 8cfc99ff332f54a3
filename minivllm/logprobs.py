"""Log-probabilities of chosen tokens and of the most likely ones (vLLM's logprobs).

Taken from the model's raw logits, before biases, penalties and temperature change them
(vLLM's default ``logprobs_mode="raw_logprobs"``): what the model thinks, not what the
request's sampling settings drew from. Only rows of requests that asked are computed.
"""

from __future__ import annotations

import torch

from minivllm.outputs import Logprob, SampleLogprobs


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> SampleLogprobs:
    """logits ``[rows, vocab]``; row ``i`` gets a dict with ``token_ids[i]``'s logprob and
    rank first, then its ``num_top[i]`` most likely tokens in rank order (a token among
    them appears once). Rank: 1 + how many tokens are strictly more likely."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen_logprobs = logprobs.gather(1, chosen)
    chosen_ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    max_top = max(num_top)
    top_logprobs, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    rows = []
    for i, (token, logprob, rank) in enumerate(
        zip(token_ids, chosen_logprobs[:, 0].tolist(), chosen_ranks.tolist())
    ):
        row = {token: Logprob(logprob, rank)}
        if num_top[i]:
            top = zip(top_ids[i, : num_top[i]].tolist(), top_logprobs[i, : num_top[i]].tolist())
            for top_rank, (top_token, top_logprob) in enumerate(top, start=1):
                row.setdefault(top_token, Logprob(top_logprob, top_rank))
        rows.append(row)
    return rows
