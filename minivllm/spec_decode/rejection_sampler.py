"""Verify draft tokens against the target model, keeping its output distribution exact.

A request with ``d`` drafts had ``d + 1`` rows computed: its last known token, then the
drafts. Row ``j``'s logits are the target model's distribution ``p_j`` for the token at
draft position ``j``; row ``d``'s is the "bonus" position after the last draft. Every
request emits at least one token and at most ``d + 1``.

- Greedy: accept the longest run of drafts equal to the target's argmax, then emit the
  argmax at the first mismatch (the correction), or at row ``d`` if all were accepted (the
  bonus). The output is exactly plain greedy decoding's.
- Random (speculative sampling, Leviathan et al. 2023; Chen et al. 2023): n-gram drafts
  are one-hot guesses (q(x) = 1), so draft ``x`` is accepted with probability ``p_j(x)``.
  At the first rejection the emitted token is drawn from ``p_j`` with ``x`` removed and
  renormalised: overall, token ``j`` is ``x`` with probability ``p_j(x)`` and any other
  ``y`` with ``(1 - p_j(x)) * p_j(y) / (1 - p_j(x)) = p_j(y)``, i.e. exactly ``p_j``. If
  every draft is accepted, the bonus token is drawn from ``p_d``.

Random numbers come from each request's own generator, so a seeded request is
reproducible. ``p`` is the plain sampler's, computed by the same functions
(`apply_token_bias`, `sampling_probs`): ``allowed_token_ids`` and ``logit_bias``, which
do not depend on the position, then temperature, top-k and top-p. (Requests with
``min_p`` or penalties get no drafts, as in vLLM: a penalty depends on the tokens before
each draft.)
"""

from __future__ import annotations

import torch

from minivllm.logprobs import sample_logprobs
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampler import Sampler, apply_token_bias, sampling_probs
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler_output import ScheduledChunk


class RejectionSampler:
    def __call__(
        self, logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams, generator
    ) -> list[int]:
        """logits ``[num_drafts + 1, vocab_size]``: the tokens this request emits."""
        assert not params.has_penalties  # the scheduler gives such requests no drafts
        if params.greedy:
            logits = apply_token_bias(logits.float(), [params] * logits.shape[0])
            return accept_greedy(logits.argmax(dim=-1).tolist(), draft_token_ids)
        return accept_random(target_probs(logits, params), draft_token_ids, generator)


def sample_with_drafts(
    logits: torch.Tensor, chunks: list[ScheduledChunk], sampler: Sampler
) -> ModelRunnerOutput:
    """A step where some decodes carry drafts (the model runner hands it over). logits:
    the sampled rows, chunk after chunk, ``1 + num_draft_tokens`` each. A chunk with drafts
    is verified here; the others are sampled by the plain ``sampler``, one row each."""
    plain, verified, first_row = [], {}, 0
    for chunk in chunks:
        num_rows = 1 + chunk.num_draft_tokens
        if chunk.num_draft_tokens:
            verified[chunk.request_id] = _REJECTION_SAMPLER(
                logits[first_row : first_row + num_rows],
                chunk.draft_token_ids,
                chunk.sampling_params,
                chunk.generator,
            )
        else:
            plain.append((chunk, first_row))
        first_row += num_rows
    if not plain:
        return ModelRunnerOutput(verified)
    plain_chunks, plain_rows = (list(x) for x in zip(*plain))
    plain_logits = logits[plain_rows]
    tokens = sampler(plain_logits, plain_chunks)
    sampled = {c.request_id: [t] for c, t in zip(plain_chunks, tokens)}
    output = ModelRunnerOutput(sampled | verified)
    # A request asking for logprobs gets no drafts (spec_decode/scheduler.py).
    output.logprobs = sample_logprobs(plain_logits, plain_chunks, sampled)
    return output


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The target's argmax at every position up to and including the first mismatch."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return target_token_ids[: num_accepted + 1]


def accept_random(probs: torch.Tensor, draft_token_ids: list[int], generator) -> list[int]:
    """probs ``[num_drafts + 1, vocab_size]``; exact speculative sampling for one-hot drafts."""
    emitted = []
    for position, draft in enumerate(draft_token_ids):
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[position, draft]:
            emitted.append(draft)
            continue
        residual = probs[position].clone()
        residual[draft] = 0  # p without x: the exponential race renormalises implicitly
        return emitted + [sample(residual, generator)]
    return emitted + [sample(probs[len(draft_token_ids)], generator)]


def sample(probs: torch.Tensor, generator) -> int:
    """One index drawn with probability proportional to ``probs`` (the sampler's
    exponential race: ``argmax(probs / E)``, ``E ~ Exp(1)``)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[rows, vocab]`` probabilities the plain sampler would draw from for ``params``."""
    rows_params = [params] * logits.shape[0]
    return sampling_probs(apply_token_bias(logits.float(), rows_params), rows_params)


_REJECTION_SAMPLER = RejectionSampler()
