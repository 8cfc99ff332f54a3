"""Log-probabilities of chosen tokens and of the most likely ones (vLLM's logprobs).

Taken from the model's raw logits, before biases, penalties and temperature change them
(vLLM's default ``logprobs_mode="raw_logprobs"``): what the model thinks, not what the
request's sampling settings drew from. Only rows of requests that asked are computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.outputs import Logprob, SampleLogprobs

if TYPE_CHECKING:
    from minivllm.scheduler_output import ScheduledChunk


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


def sample_logprobs(
    logits: torch.Tensor, chunks: list[ScheduledChunk], sampled: dict[str, list[int]]
) -> dict[str, SampleLogprobs]:
    """Row ``i`` of ``logits`` sampled chunk ``i``'s token: for each chunk that asked, that
    token's logprob and the top ones."""
    asking = [i for i, c in enumerate(chunks) if c.sampling_params.logprobs is not None]
    if not asking:
        return {}
    ids = [chunks[i].request_id for i in asking]
    rows = compute_logprobs(
        logits[asking],
        [sampled[r][0] for r in ids],
        [chunks[i].sampling_params.logprobs for i in asking],
    )
    return {r: [row] for r, row in zip(ids, rows)}


def prompt_logprobs(
    logits: torch.Tensor, chunks: list[ScheduledChunk]
) -> dict[str, tuple[int, SampleLogprobs]]:
    """logits: the prompt rows of ``chunks``, back to back. Each chunk's request gets the
    index of the first prompt token its rows predict, and their dicts."""
    targets = [t for c in chunks for t in c.prompt_logprob_token_ids]
    num_top = [
        c.sampling_params.prompt_logprobs for c in chunks for _ in c.prompt_logprob_token_ids
    ]
    rows = compute_logprobs(logits, targets, num_top)
    result, first = {}, 0
    for c in chunks:
        num = len(c.prompt_logprob_token_ids)
        result[c.request_id] = (c.start_position + 1, rows[first : first + num])
        first += num
    return result
