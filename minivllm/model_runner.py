"""Turn the scheduler's decision into one flattened, unpadded batch and run the model.

Per step the runner builds, once, the tensors every layer shares: input token ids and
positions for all scheduled tokens back to back, the cache slot each new token's K/V goes
to, and the attention metadata (query/context lengths, block tables). It samples only at
each chunk's last row, and only for chunks the scheduler marked to sample (a prefill
chunk in the middle of a prompt has nothing to say); a decode with draft tokens also at
every draft row, verified by speculative decoding (spec_decode/rejection_sampler.py). A
request that asked for ``prompt_logprobs`` gets logits at its prompt rows too
(logprobs.py); nobody else pays for them. It reads nothing but the chunks, and the blocks
to copy first (copy-on-write, kv_cache_manager.py), and writes into neither: why a chunk
or a copy is there is the scheduler's business.

The inputs are built by a persistent `InputBatch` (input_batch.py) that keeps the block
tables from step to step (docs/engine-overhead.md measured why).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minivllm.attention import AttentionMetadata
from minivllm.input_batch import InputBatch
from minivllm.logprobs import prompt_logprobs, sample_logprobs
from minivllm.models.arithmetic import kv_heads_per_rank
from minivllm.models.llama import CausalLM
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampler import Sampler, apply_grammar_bitmask
from minivllm.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledChunk, SchedulerOutput
from minivllm.utils import resolve_obj_by_qualname


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_kv_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
        tensor_parallel_size: int = 1,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        config = model.config
        # The whole KV cache, allocated once: [layer][key or value][block][slot][kv_head][dim].
        # Requests own blocks of it through their block tables; nothing here ever moves (a
        # tensor-parallel rank holds its own KV heads). Empty: a slot is written before it
        # is read, and zero-filling a GiB costs seconds on a small machine.
        self.kv_caches = torch.empty(
            config.num_layers, 2, num_kv_blocks, block_size,
            kv_heads_per_rank(config.num_kv_heads, tensor_parallel_size), config.head_dim,
            dtype=dtype, device=device,
        )  # fmt: skip
        self.input_batch = InputBatch(block_size, device)  # kept from step to step
        self.sampler = Sampler(eos_token_ids)  # masks EOS before min_tokens
        # Async scheduling: the last step's sampled token per request, the input of a
        # decode scheduled before that token was known (async_scheduler.py).
        self.prev_sampled_token_ids: dict[str, int] = {}

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and the step's metadata, from the persistent batch: only
        what changed since last step is rewritten."""
        return self.input_batch.prepare(scheduler_output)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for each chunk that samples: one, or
        with draft tokens, the accepted drafts and one more; and the logprobs of requests
        that asked."""
        self.copy_blocks(scheduler_output.blocks_to_copy)
        output = self._execute_model(scheduler_output)
        self.prev_sampled_token_ids = {r: t[-1] for r, t in output.sampled_token_ids.items()}
        return output

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write, decided by the KV cache manager: block ``dst`` gets block ``src``'s
        keys and values in every layer, before the forward writes anything. All sources
        are gathered before any target is written."""
        if not blocks_to_copy:
            return
        src, dst = zip(*blocks_to_copy)
        self.kv_caches[:, :, list(dst)] = self.kv_caches[:, :, list(src)]

    def _fill_placeholders(
        self, chunks: list[ScheduledChunk], input_ids: torch.Tensor
    ) -> list[ScheduledChunk]:
        """Async scheduling: a decode scheduled while the step before ran has that step's
        sample as its one input; the runner kept it and writes it into the input ids. The
        record stays the scheduler's: for penalties the sampler gets a copy of the chunk."""
        filled = [c.request_id for c in chunks if c.token_ids[-1] == PLACEHOLDER_TOKEN_ID]
        if not filled:
            return chunks
        token_of = {r: self.prev_sampled_token_ids[r] for r in filled}  # in the rows' order
        input_ids[input_ids == PLACEHOLDER_TOKEN_ID] = input_ids.new_tensor(list(token_of.values()))
        return [  # penalties count the outputs so far, the filled token included
            replace(c, output_token_ids=c.output_token_ids + [token_of[c.request_id]])
            if c.request_id in token_of and c.sampling_params.has_penalties
            else c
            for c in chunks
        ]

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        input_ids, positions, metadata = self.prepare_inputs(scheduler_output)
        chunks = self._fill_placeholders(scheduler_output.chunks, input_ids)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)

        # A chunk that samples needs logits at its last row, and with d drafts at its last
        # 1 + d rows (row j verifies draft j; the last row gives the bonus token).
        ends = metadata.cu_seqlens_q[1:].tolist()
        sampling = [(c, end) for c, end in zip(chunks, ends) if c.sample]
        # A request asking for prompt logprobs needs logits at its prompt rows too (after).
        prompt_chunks = [
            (c, end - len(c.token_ids))
            for c, end in zip(chunks, ends)
            if c.prompt_logprob_token_ids
        ]
        if not sampling and not prompt_chunks:
            return ModelRunnerOutput()
        rows = [row for c, end in sampling for row in range(end - 1 - c.num_draft_tokens, end)]
        num_sampled_rows = len(rows)
        rows += [
            row
            for c, first in prompt_chunks
            for row in range(first, first + len(c.prompt_logprob_token_ids))
        ]
        logits = self.model.compute_logits(hidden[rows])
        if logits is None:  # a tensor-parallel rank but the first: rank 0 samples
            return ModelRunnerOutput()
        if scheduler_output.grammar_bitmask is not None:  # structured outputs' rows
            mask = scheduler_output.grammar_bitmask
            logits = apply_grammar_bitmask(logits, mask.rows, mask.bitmask)
        output = self._sample(logits[:num_sampled_rows], [c for c, _ in sampling])
        if prompt_chunks:
            output.prompt_logprobs = prompt_logprobs(
                logits[num_sampled_rows:], [c for c, _ in prompt_chunks]
            )
        return output

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """logits: the sampled rows, chunk after chunk (``1 + num_draft_tokens`` each)."""
        if len(logits) != len(chunks):  # drafts to verify: speculative decoding's sampling
            verify = resolve_obj_by_qualname(_SAMPLE_WITH_DRAFTS)
            return verify(logits, chunks, self.sampler)
        tokens = self.sampler(logits, chunks) if chunks else []
        output = ModelRunnerOutput({c.request_id: [t] for c, t in zip(chunks, tokens)})
        output.logprobs = sample_logprobs(logits, chunks, output.sampled_token_ids)
        return output


_SAMPLE_WITH_DRAFTS = "minivllm.spec_decode.rejection_sampler.sample_with_drafts"
