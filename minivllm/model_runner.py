"""Turn the scheduler's decision into one flattened, unpadded batch and run the model.

Per step the runner builds, once, the tensors every layer shares: input token ids and
positions for all scheduled tokens back to back, the cache slot each new token's K/V goes
to, and the attention metadata (query/context lengths, block tables). It samples only at
each chunk's last row, and only for chunks the scheduler marked to sample (a prefill
chunk in the middle of a prompt has nothing to say); a decode with draft tokens also at
every draft row, to verify the drafts. A request that asked for ``prompt_logprobs`` gets
logits at its prompt rows too (logprobs.py); nobody else pays for them. It reads nothing
but the chunks, and the blocks to copy first (copy-on-write, kv_cache_manager.py): why a
chunk or a copy is there is the scheduler's business.

The inputs are built by a persistent `InputBatch` (input_batch.py) that keeps the block
tables from step to step: at hundreds of requests, rebuilding them every step cost more
CPU time than the rest of the runner (docs/tutorial/what-a-gpu-would-do.md, "The engine's
own time per step").
"""

from __future__ import annotations

import torch

from minivllm.attention import AttentionMetadata
from minivllm.input_batch import InputBatch
from minivllm.logprobs import compute_logprobs
from minivllm.models.arithmetic import kv_heads_per_rank
from minivllm.models.llama import CausalLM
from minivllm.outputs import ModelRunnerOutput, SampleLogprobs
from minivllm.sampler import Sampler, apply_grammar_bitmask
from minivllm.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledChunk, SchedulerOutput
from minivllm.spec_decode import RejectionSampler


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
        # Requests own blocks of it through their block tables; nothing here ever moves.
        # Split across tensor-parallel ranks, each holds only its own KV heads, under the
        # same block tables and slots.
        # torch.empty: a slot is always written before it is read (nothing reads past
        # context_len), and zero-filling a GiB costs seconds on a small machine.
        self.kv_caches = torch.empty(
            config.num_layers, 2, num_kv_blocks, block_size,
            kv_heads_per_rank(config.num_kv_heads, tensor_parallel_size), config.head_dim,
            dtype=dtype, device=device,
        )  # fmt: skip
        self.input_batch = InputBatch(block_size, device)  # kept from step to step
        self.sampler = Sampler(eos_token_ids)  # masks EOS before min_tokens
        self.rejection_sampler = RejectionSampler()
        # Async scheduling: the last step's sampled token per request, the input of a
        # decode scheduled before that token was known (async_scheduler.py).
        self.prev_sampled_token_ids: dict[str, int] = {}

    def prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids ``[num_tokens]``, positions ``[num_tokens]`` and the step's metadata,
        from the persistent batch (input_batch.py): only what changed since last step is
        rewritten."""
        return self.input_batch.prepare(scheduler_output)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the tokens sampled for each chunk that samples: one, or
        with draft tokens, the accepted drafts and one more; and the logprobs of requests
        that asked."""
        self.copy_blocks(scheduler_output.blocks_to_copy)
        self.fill_placeholders(scheduler_output)
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

    def fill_placeholders(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: a decode scheduled while the step before was running has that
        step's sample as its input; the runner has it (on a GPU it would stay on the device)."""
        for chunk in scheduler_output.chunks:
            if chunk.token_ids[-1] != PLACEHOLDER_TOKEN_ID:
                continue
            assert len(chunk.token_ids) == 1, "only a decode's one input can be a placeholder"
            token_id = self.prev_sampled_token_ids[chunk.request_id]
            chunk.token_ids = [token_id]
            if chunk.sampling_params.has_penalties:  # the sampler counts the outputs so far
                chunk.output_token_ids = chunk.output_token_ids + [token_id]

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        input_ids, positions, metadata = self.prepare_inputs(scheduler_output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)

        # A chunk that samples needs logits at its last row, and with d drafts at its last
        # 1 + d rows (row j verifies draft j; the last row gives the bonus token).
        ends = metadata.cu_seqlens_q[1:].tolist()
        sampling = [(c, end) for c, end in zip(scheduler_output.chunks, ends) if c.sample]
        # A request asking for prompt logprobs needs logits at every prompt row too; they
        # come after the sampled rows.
        prompt_chunks = [
            (c, end - len(c.token_ids))
            for c, end in zip(scheduler_output.chunks, ends)
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
            output.prompt_logprobs = self._prompt_logprobs(
                logits[num_sampled_rows:], [c for c, _ in prompt_chunks]
            )
        return output

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> ModelRunnerOutput:
        """logits: the sampled rows, chunk after chunk (``1 + num_draft_tokens`` each)."""
        if not chunks:
            return ModelRunnerOutput()
        if len(logits) == len(chunks):  # the usual step, no drafts: row i is chunk i's
            tokens = self.sampler(logits, chunks)
            output = ModelRunnerOutput({c.request_id: [t] for c, t in zip(chunks, tokens)})
            self._add_sample_logprobs(output, logits, chunks)
            return output

        plain, verified, first_row = [], {}, 0
        for chunk in chunks:
            num_rows = 1 + chunk.num_draft_tokens
            if chunk.num_draft_tokens:
                verified[chunk.request_id] = self.rejection_sampler(
                    logits[first_row : first_row + num_rows],
                    chunk.draft_token_ids,
                    chunk.sampling_params,
                    chunk.generator,
                )
            else:
                plain.append((chunk, first_row))
            first_row += num_rows
        sampled, plain_logits = {}, None
        if plain:
            plain_chunks, plain_rows = zip(*plain)
            plain_chunks, plain_logits = list(plain_chunks), logits[list(plain_rows)]
            tokens = self.sampler(plain_logits, plain_chunks)
            sampled = {c.request_id: [t] for c, t in zip(plain_chunks, tokens)}
        output = ModelRunnerOutput(sampled | verified)
        if plain:  # a request asking for logprobs gets no drafts (scheduler.py)
            self._add_sample_logprobs(output, plain_logits, plain_chunks)
        return output

    @staticmethod
    def _add_sample_logprobs(
        output: ModelRunnerOutput, logits: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> None:
        """The sampled token's logprob and the top ones, for the rows that asked."""
        asking = [i for i, c in enumerate(chunks) if c.sampling_params.logprobs is not None]
        if not asking:
            return
        ids = [chunks[i].request_id for i in asking]
        rows = compute_logprobs(
            logits[asking],
            [output.sampled_token_ids[r][0] for r in ids],
            [chunks[i].sampling_params.logprobs for i in asking],
        )
        output.logprobs = {r: [row] for r, row in zip(ids, rows)}

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> dict[str, tuple[int, SampleLogprobs]]:
        """logits: the prompt rows of ``chunks``, back to back. Each chunk's request gets
        the index of the first prompt token its rows predict, and their dicts."""
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
