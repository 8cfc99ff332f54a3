"""What the scheduler decided for one step (vLLM: ``vllm/v1/core/sched/output.py``).

The model runner reads only ``chunks`` and ``blocks_to_copy``: for each chunk, token ids to
compute, the position of the first one, and the block table whose slots hold the request's
keys and values; and the blocks to copy before the step (copy-on-write). It knows nothing
about why a chunk or a copy is there. The rest is for the scheduler's own
bookkeeping after the step and for whoever watches (metrics, notebooks).

It is a value, as in vLLM (which builds its ``SchedulerOutput`` once every decision is
made): each chunk holds its own copy of its token ids and an immutable tuple of its block
table, taken when its decision is final, so the requests moving on after the step
(rejected drafts rolled back, blocks freed) never rewrite the record of what the step
computed. The tuple is shared with the request's earlier steps while its table does not
change (vLLM sends only the new block ids for the same reason: a table grows with the
context, and copying every table every step costs the CPU that much). Only
``scheduled_seqs`` and ``preempted`` point at the live requests, to say *who*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

if TYPE_CHECKING:
    import torch

# Async scheduling: the input of a decode whose token the step before is still sampling.
# The model runner replaces it with that sample before the step runs.
PLACEHOLDER_TOKEN_ID = -1
# Static batching: what padding rows feed the model; their outputs are thrown away.
PAD_TOKEN_ID = 0


@dataclass(slots=True)  # slots: one is built per scheduled request per step
class ScheduledChunk:
    """Token rows of one request that the model computes this step.

    Row ``i`` is the token at position ``start_position + i``; its key and value go to
    that position's slot in ``block_table``, and it attends to every earlier position.
    ``sample``: a token is sampled from the last row's logits (so ``sampling_params`` and
    ``generator`` are the request's, and ``num_output_tokens`` how many it has so far, for
    ``min_tokens``); False for a prompt chunk that stops mid-prompt.
    Speculative decoding: the last ``num_draft_tokens`` rows are draft tokens, guesses not
    yet known to be right; then the last ``1 + num_draft_tokens`` rows are all sampled
    and verified against the drafts (spec_decode/rejection_sampler.py).
    ``block_table`` is the request's table as of this step, an immutable tuple: a step whose
    table did not change shares the tuple of the step before instead of copying the table
    (`Sequence.block_table_snapshot`). ``block_table_id`` says which table it is (a new
    id: not the table of an earlier step).
    ``prompt_token_ids`` and ``output_token_ids``: the request's tokens so far, filled
    only when it samples with penalties (the sampler counts them); empty otherwise.
    ``prompt_logprob_token_ids``: for a request that asked for ``prompt_logprobs``, the
    prompt tokens this chunk's first rows predict (row ``i``: the token at position
    ``start_position + i + 1``); empty otherwise."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: tuple[int, ...]
    sample: bool
    sampling_params: SamplingParams | None = None
    generator: object | None = None  # torch.Generator of a request that samples randomly
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    block_table_id: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprob_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Immutable: the request's table moves on. (A tuple's tuple() is itself, no copy.)
        self.block_table = tuple(self.block_table)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    @property
    def context_len(self) -> int:
        """Positions the last row attends to, itself included."""
        return self.start_position + len(self.token_ids)


@dataclass
class GrammarBitmask:
    """The masks of one step: ``bitmask[i]`` applies to sampled row ``rows[i]`` (rows
    numbered as the model runner samples them: each sampling chunk in order, ``1 +
    num_draft_tokens`` rows each). Rows not listed are not masked. Structured outputs
    (structured_output/) build it; it lives with the step record it belongs to."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words], int32


@dataclass
class SchedulerOutput:
    """One step: ``num_scheduled_tokens[request_id]`` new tokens for each request in
    ``scheduled_seqs``, computed as ``chunks``. A scheduler may add chunks that advance no
    request (static batching's padding, `add_padding`): their rows are computed and thrown
    away, and counted as they are added."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Whether each request's chunk catches up on known tokens (prefill) or computes the
    # token just sampled (decode); fixed here, as the sequence moves on after the step.
    is_prefill: dict[str, bool] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    # Speculative decoding: the draft tokens scheduled after each decode's real token
    # (counted in num_scheduled_tokens too, as in vLLM).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Each scheduled request's chunk, by id (a padding chunk is in ``chunks`` only).
    chunk_of: dict[str, ScheduledChunk] = field(default_factory=dict, repr=False)
    # Copy-on-write (kv_cache_manager.py): (src, dst) block ids whose keys and values the
    # runner copies, in every layer, before this step's forward (vLLM v0's blocks_to_copy).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Padding: the request id of each chunk that advances no request, and their rows.
    wasted_ids: list[str] = field(default_factory=list)
    num_wasted_tokens: int = 0
    # Structured outputs: the token masks of the sampled rows of constrained requests,
    # filled by the engine after scheduling (structured_output/); None in a step without one.
    grammar_bitmask: GrammarBitmask | None = None

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Schedule the next ``num_new_tokens`` of ``seq``, from its ``num_computed_tokens``."""
        start = seq.num_computed_tokens
        token_ids = seq.token_ids[start : start + num_new_tokens]
        if len(token_ids) < num_new_tokens:
            # Async scheduling: past the known ids, tokens still being sampled (placeholders).
            token_ids += [PLACEHOLDER_TOKEN_ID] * (num_new_tokens - len(token_ids))
        params = seq.sampling_params
        num_output_tokens = seq.num_output_tokens + seq.num_output_placeholders
        # It reaches its last known token (placeholders count as known).
        samples = start + num_new_tokens == seq.num_prompt_tokens + num_output_tokens
        chunk = ScheduledChunk(
            seq.request_id,
            token_ids,
            start,
            seq.block_table_snapshot(),
            sample=samples,
            sampling_params=params,
            generator=seq.generator,
            num_output_tokens=num_output_tokens,
            block_table_id=seq.block_table_id,
        )
        if samples and params.has_penalties:
            chunk.prompt_token_ids = seq.prompt_token_ids
            chunk.output_token_ids = seq.output_token_ids
        if params.prompt_logprobs is not None:
            end = min(start + num_new_tokens, seq.num_prompt_tokens - 1)
            chunk.prompt_logprob_token_ids = seq.prompt_token_ids[start + 1 : end + 1]
        self.chunks.append(chunk)
        self.chunk_of[seq.request_id] = chunk
        self.scheduled_seqs.append(seq)
        self.num_scheduled_tokens[seq.request_id] = num_new_tokens
        self.is_prefill[seq.request_id] = seq.is_prefill

    def add_padding(self, seq: Sequence, position: int, num_rows: int) -> None:
        """``num_rows`` rows at ``position...`` in ``seq``'s blocks, computed and thrown
        away. To attention they are one more sequence; they advance nobody and sample
        nothing. The table is the request's own snapshot: no copy per step."""
        padding = [PAD_TOKEN_ID] * num_rows
        table = seq.block_table_snapshot()
        self.chunks.append(ScheduledChunk(seq.request_id, padding, position, table, sample=False))
        self.wasted_ids.append(seq.request_id)
        self.num_wasted_tokens += num_rows

    def add_draft_tokens(self, seq: Sequence, draft_token_ids: list[int]) -> None:
        """Extend ``seq``'s decode chunk, already scheduled, with draft tokens, once the
        blocks for their rows are allocated: the chunk's table is taken again to hold them."""
        assert not self.is_prefill[seq.request_id] and draft_token_ids
        chunk = self.chunk_of[seq.request_id]
        chunk.token_ids = chunk.token_ids + list(draft_token_ids)
        chunk.block_table = seq.block_table_snapshot()
        chunk.num_draft_tokens = len(draft_token_ids)
        self.num_scheduled_tokens[seq.request_id] += len(draft_token_ids)
        self.scheduled_spec_decode_tokens[seq.request_id] = list(draft_token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.scheduled_spec_decode_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_rows(self) -> int:
        """Token rows the model computes, wasted ones included."""
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for r, n in self.num_scheduled_tokens.items() if not self.is_prefill[r])

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_decode_tokens

    @property
    def decode_ids(self) -> list[str]:
        return [r for r, prefill in self.is_prefill.items() if not prefill]

    @property
    def prefill_ids(self) -> list[str]:
        return [r for r, prefill in self.is_prefill.items() if prefill]
