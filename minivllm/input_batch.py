"""The model runner's input batch, kept from step to step (vLLM v1's persistent batch).

A step's inputs are mostly last step's inputs: the same requests, each one token further,
and now and then one more block in a block table. Rebuilding every block table from
Python lists each step costs the CPU time of every request's whole table (tens of entries
each, at hundreds of requests: milliseconds the GPU waits for). So the block tables live
in one numpy array, one row per request, and a step writes only what changed: the row of a
request that joins, the new blocks of one that grew. Positions and cache slots are then
computed for all tokens at once with numpy, not per token in Python. A request whose table
did not change at all hands over the very tuple of the step before (scheduler_output.py),
so its row is skipped after one identity check.
(docs/tutorial/what-a-gpu-would-do.md, "The engine's own time per step", measures it.)

How a change is seen without the scheduler listing it: the `KVCacheManager` only appends
blocks to a table it handed out, and gives a table a new ``block_table_id`` whenever it
does anything else: a new table at admission (a new request, one back after preemption,
a finished request's id reused) or one cut short after rejected draft tokens. So a row
whose id matches the chunk's has only gained blocks at its end: only those are copied.
Any other row is written whole. A request absent from a step leaves the batch.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from minivllm.attention import AttentionMetadata
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, max_num_reqs: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        # [row, block]: row r holds the block table of request req_ids[r], 0 past its end.
        self.block_tables = np.zeros((max_num_reqs, 16), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # valid entries per row
        self.table_ids = np.zeros(max_num_reqs, dtype=np.int64)  # whose table the row holds
        # The chunk's block-table tuple each row was last written from: a request whose
        # table did not change hands the runner the same tuple again (scheduler_output.py),
        # so one identity check skips the row, with no numpy scalar reads.
        self.row_sources: list[tuple[int, ...] | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}  # request id -> row
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def prepare(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids ``[num_tokens]``, positions ``[num_tokens]`` and the step's metadata,
        for the chunks back to back in the scheduler's order."""
        chunks = scheduler_output.chunks
        num_chunks = len(chunks)
        rows = np.fromiter((self._update_row(c) for c in chunks), np.int64, num_chunks)
        self._drop_absent({c.request_id for c in chunks})
        query_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, num_chunks)
        starts = np.fromiter((c.start_position for c in chunks), np.int64, num_chunks)
        num_tokens = int(query_lens.sum())
        input_ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), np.int64,
                                num_tokens)  # fmt: skip

        cu_seqlens_q = np.zeros(num_chunks + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        context_lens = starts + query_lens
        max_blocks = int(self.num_blocks[rows].max())
        block_tables = self.block_tables[rows, :max_blocks]  # a copy: rows change next step

        # Position of every token: its chunk's start + its index inside the chunk.
        seq_of_token = np.repeat(np.arange(num_chunks), query_lens)
        positions = np.arange(num_tokens) + np.repeat(starts - cu_seqlens_q[:-1], query_lens)
        # The paged address: token `pos` lives in block `block_table[pos // block_size]`.
        blocks = block_tables[seq_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device=self.device, non_blocking=True)

        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            cu_seqlens_q=to_device(cu_seqlens_q),
            context_lens=to_device(context_lens.astype(np.int32)),
            block_tables=to_device(block_tables),
            max_query_len=int(query_lens.max()),
            max_context_len=int(context_lens.max()),
        )
        return to_device(input_ids), to_device(positions), metadata

    def _update_row(self, chunk: ScheduledChunk) -> int:
        """The chunk's request's row, brought up to date with its block table."""
        row = self.row_of.get(chunk.request_id)
        if row is None:
            row = self.row_of[chunk.request_id] = self._take_row()
        elif self.row_sources[row] is chunk.block_table:
            return row  # most decodes: the same table as last step
        self.row_sources[row] = chunk.block_table
        table, num_known = chunk.block_table, self.num_blocks[row]
        if self.table_ids[row] != chunk.block_table_id or len(table) < num_known:
            num_known = 0  # another table, not this one grown
        if num_known == 0:
            self.block_tables[row] = 0
        if len(table) > num_known:
            if len(table) > self.block_tables.shape[1]:
                self._grow(num_cols=2 * len(table))
            self.block_tables[row, num_known : len(table)] = table[num_known:]
        self.num_blocks[row] = len(table)
        # A padding chunk (static batching) follows its request's real one: same table.
        self.table_ids[row] = chunk.block_table_id
        return row

    def _drop_absent(self, request_ids: set[str]) -> None:
        if len(self.row_of) == len(request_ids):
            return  # every row was scheduled (ids in a step are distinct rows)
        for request_id in [r for r in self.row_of if r not in request_ids]:
            row = self.row_of.pop(request_id)
            self.num_blocks[row] = 0
            self.row_sources[row] = None
            self.free_rows.append(row)

    def _take_row(self) -> int:
        if not self.free_rows:
            old = len(self.num_blocks)
            self._grow(num_rows=2 * old)
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def _grow(self, num_rows: int | None = None, num_cols: int | None = None) -> None:
        old_rows, old_cols = self.block_tables.shape
        num_rows, num_cols = num_rows or old_rows, num_cols or old_cols
        block_tables = np.zeros((num_rows, num_cols), dtype=np.int32)
        block_tables[:old_rows, :old_cols] = self.block_tables
        self.block_tables = block_tables
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(num_rows - old_rows, np.int64)])
        self.table_ids = np.concatenate([self.table_ids, np.zeros(num_rows - old_rows, np.int64)])
        self.row_sources += [None] * (num_rows - old_rows)
