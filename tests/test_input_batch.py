"""The persistent input batch (minivllm/input_batch.py) through `InputBatch.prepare` only:
each step's flat tensors hold exactly the values the paged layout defines, whatever the
batch remembers from earlier steps (requests that grow, leave, come back with another
table, more requests or longer tables than it first made room for)."""

from __future__ import annotations

import tracemalloc

import torch

from minivllm.input_batch import InputBatch
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput

BLOCK_SIZE = 4


def step(*chunks: ScheduledChunk) -> SchedulerOutput:
    return SchedulerOutput(chunks=list(chunks))


def chunk(request_id, token_ids, start, table, table_id=1) -> ScheduledChunk:
    return ScheduledChunk(request_id, list(token_ids), start, list(table), sample=True,
                          block_table_id=table_id)  # fmt: skip


def expected_slots(start: int, num_tokens: int, table: list[int]) -> list[int]:
    positions = range(start, start + num_tokens)
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_a_mixed_step_is_laid_out_back_to_back_with_its_paged_addresses():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    prefill = chunk("a", [11, 12, 13, 14, 15, 16], 2, [7, 3], table_id=1)  # positions 2-7
    decode = chunk("b", [21], 9, [5, 8, 2], table_id=2)  # position 9: block 2, offset 1
    input_ids, positions, md = batch.prepare(step(prefill, decode))
    assert input_ids.tolist() == [11, 12, 13, 14, 15, 16, 21]
    assert positions.tolist() == [2, 3, 4, 5, 6, 7, 9]
    assert md.slot_mapping.tolist() == (
        expected_slots(2, 6, [7, 3]) + expected_slots(9, 1, [5, 8, 2])
    )
    assert md.slot_mapping.tolist() == [30, 31, 12, 13, 14, 15, 9]
    assert md.cu_seqlens_q.tolist() == [0, 6, 7]
    assert md.context_lens.tolist() == [8, 10]
    assert md.block_tables.tolist() == [[7, 3, 0], [5, 8, 2]]  # padded to the longest
    assert (md.max_query_len, md.max_context_len) == (6, 10)
    assert input_ids.dtype == positions.dtype == md.slot_mapping.dtype == torch.int64
    assert md.cu_seqlens_q.dtype == md.context_lens.dtype == md.block_tables.dtype == torch.int32


def test_a_request_that_grows_gets_its_new_blocks_and_keeps_its_old_ones():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.prepare(step(chunk("a", range(4), 0, [7], table_id=1)))
    _, _, md = batch.prepare(step(chunk("a", [9], 4, [7, 2], table_id=1)))  # one more block
    assert md.block_tables.tolist() == [[7, 2]]
    assert md.slot_mapping.tolist() == [2 * BLOCK_SIZE]  # position 4: block 2, offset 0
    _, _, md = batch.prepare(step(chunk("a", [9], 5, [7, 2], table_id=1)))  # nothing new
    assert md.block_tables.tolist() == [[7, 2]]


def test_a_new_table_replaces_the_old_one_wherever_it_differs():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.prepare(step(chunk("a", range(12), 0, [7, 3, 5], table_id=1)))
    # Drafts rejected: the manager cut the table and took another block (a new id).
    _, _, md = batch.prepare(step(chunk("a", [1], 4, [7, 9], table_id=2)))
    assert md.block_tables.tolist() == [[7, 9]]
    assert md.slot_mapping.tolist() == [9 * BLOCK_SIZE]
    # Preempted and readmitted with the same number of blocks, all different.
    _, _, md = batch.prepare(step(chunk("a", range(8), 0, [1, 4], table_id=3)))
    assert md.block_tables.tolist() == [[1, 4]]
    # Cut short under the same id is not "grown": the shorter table is taken whole.
    _, _, md = batch.prepare(step(chunk("a", [1], 0, [6], table_id=3)))
    assert md.block_tables.tolist() == [[6]]
    _, _, md = batch.prepare(step(chunk("a", [1], 4, [6, 8], table_id=3)))
    assert md.block_tables.tolist() == [[6, 8]]


def test_a_request_that_leaves_and_comes_back_has_no_trace_of_its_old_table():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.prepare(step(chunk("a", range(8), 0, [7, 3], table_id=1), chunk("b", [1], 0, [2], 2)))
    batch.prepare(step(chunk("b", [1], 1, [2], table_id=2)))  # "a" left (finished)
    # Its id used again by a new request, whose table has the same id by chance.
    _, _, md = batch.prepare(step(chunk("b", [1], 2, [2], 2), chunk("a", [5], 0, [9], 1)))
    assert md.block_tables.tolist() == [[2], [9]]
    assert md.slot_mapping.tolist() == [2 * BLOCK_SIZE + 2, 9 * BLOCK_SIZE]


def test_more_requests_and_longer_tables_than_it_first_made_room_for():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"), max_num_reqs=2)
    tables = {f"r{i}": [100 + i] * (i + 1) for i in range(5)}  # 5 requests, 2 rows
    chunks = [chunk(r, [1], len(t) * BLOCK_SIZE - 1, t, i + 1)
              for i, (r, t) in enumerate(tables.items())]  # fmt: skip
    _, _, md = batch.prepare(step(*chunks))
    assert md.block_tables.tolist() == [t + [0] * (5 - len(t)) for t in tables.values()]
    long_table = [100] + list(range(1, 40))  # grown beyond the 16 columns it starts with
    chunks[0] = chunk("r0", [1], 40 * BLOCK_SIZE - 1, long_table, table_id=1)
    _, _, md = batch.prepare(step(*chunks))
    assert md.block_tables.tolist()[0] == long_table
    assert md.block_tables.dtype == torch.int32  # grown, still int32
    assert md.block_tables.tolist()[4] == tables["r4"] + [0] * 35
    assert md.slot_mapping.tolist() == [39 * BLOCK_SIZE + 3] + [
        (100 + i) * BLOCK_SIZE + 3 for i in range(1, 5)
    ]
    # All but one leave; the rows they free are taken again by newcomers.
    _, _, md = batch.prepare(step(chunk("r4", [1], 0, [3], 9), chunk("new", [2], 0, [4], 10)))
    assert md.block_tables.tolist() == [[3], [4]]


def test_a_table_under_a_known_id_is_read_only_past_the_blocks_already_copied():
    """The manager only ever appends to a table it handed out (anything else gets a new
    id), so the batch copies only a table's new blocks: a step costs what changed. A
    table changed in place under its old id is therefore not seen (a broken promise)."""
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.prepare(step(chunk("a", range(8), 0, [7, 3], table_id=1)))
    _, _, md = batch.prepare(step(chunk("a", [1], 8, [6, 6, 5], table_id=1)))
    assert md.block_tables.tolist() == [[7, 3, 5]]  # only block 2 is new
    _, _, md = batch.prepare(step(chunk("a", [1], 9, [6, 6, 6], table_id=1)))
    assert md.block_tables.tolist() == [[7, 3, 5]]  # nothing new


def test_a_request_absent_from_a_step_leaves_the_batch_whatever_its_table_id():
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    batch.prepare(step(chunk("a", range(8), 0, [7, 3], table_id=1), chunk("b", [1], 0, [2], 2)))
    batch.prepare(step(chunk("b", [1], 1, [2], table_id=2)))  # "a" left
    # Back under the same id, a longer table: new to the batch, so read whole.
    _, _, md = batch.prepare(step(chunk("a", [5], 8, [9, 4, 5], table_id=1)))
    assert md.block_tables.tolist() == [[9, 4, 5]]


def test_memory_follows_the_requests_in_flight_not_the_requests_served():
    """Requests come and go, two at a time: the rows of those that left are reused."""
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"), max_num_reqs=2)
    tracemalloc.start()
    try:
        for i in range(16):
            leaving = chunk(f"r{i}", [1], 0, [i], i + 1)  # its last step
            staying = chunk(f"r{i + 1}", [2], 0, [i + 1], i + 2)  # its first
            _, _, md = batch.prepare(step(leaving, staying))
            assert md.block_tables.tolist() == [[i], [i + 1]]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a few kB of rows (a batch that kept growing: 8 MiB here)
