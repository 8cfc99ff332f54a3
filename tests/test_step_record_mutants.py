"""A step's record, model-free: what `SchedulerOutput.add` writes into each chunk.

The parts added for async scheduling, prompt logprobs and copy-on-write, each pinned by
the rule it follows: placeholders stand for tokens still being sampled and count as
known; a chunk's table is an immutable tuple shared with earlier steps only while the
table is the same; the prompt tokens a chunk's rows predict; wasted rows.
"""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.scheduler_output import (
    PAD_TOKEN_ID,
    PLACEHOLDER_TOKEN_ID,
    ScheduledChunk,
    SchedulerOutput,
)
from minivllm.sequence import Sequence


def make_seq(prompt, **params):
    return Sequence("r", list(prompt), SamplingParams(**params))


def test_a_decode_past_the_known_tokens_gets_placeholders_and_samples():
    # Async scheduling: 5 known tokens, 1 output sampled but not appended yet.
    seq = make_seq([1, 2, 3, 4], repetition_penalty=1.2)
    seq.append_token(9, now=0.0)
    seq.num_computed_tokens = 5
    seq.num_output_placeholders = 1
    assert seq.num_uncomputed_tokens == 1 and not seq.is_prefill
    out = SchedulerOutput()
    out.add(seq, 1)
    [chunk] = out.chunks
    assert chunk.token_ids == [PLACEHOLDER_TOKEN_ID] and chunk.start_position == 5
    assert chunk.sample and chunk.num_output_tokens == 2
    assert chunk.output_token_ids == [9] and chunk.prompt_token_ids == [1, 2, 3, 4]
    assert out.is_prefill == {"r": False}


def test_a_first_decode_after_a_placeholder_only_prompt_is_a_decode():
    seq = make_seq([1, 2, 3])
    seq.num_computed_tokens = 3
    seq.num_output_placeholders = 1  # sampled in the step in flight, no id yet
    assert seq.num_output_tokens == 0 and seq.num_uncomputed_tokens == 1
    assert not seq.is_prefill
    seq.num_output_placeholders = 0
    seq.num_computed_tokens = 2
    assert seq.is_prefill  # the prompt's last token: still prefill


def test_a_chunk_that_stops_before_the_last_known_token_does_not_sample():
    seq = make_seq([1, 2, 3, 4])
    out = SchedulerOutput()
    out.add(seq, 3)
    assert not out.chunks[0].sample and out.chunks[0].num_output_tokens == 0
    seq.num_output_placeholders = 1
    out = SchedulerOutput()
    out.add(seq, 4)  # reaches the prompt's end, but a placeholder is known beyond it
    assert not out.chunks[0].sample and out.chunks[0].token_ids == [1, 2, 3, 4]


def test_the_table_snapshot_is_shared_while_the_table_is_the_same():
    seq = make_seq([1, 2, 3])
    seq.block_table, seq.block_table_id = [4, 5], 7
    first = seq.block_table_snapshot()
    assert first == (4, 5) and seq.block_table_snapshot() is first
    seq.block_table.append(6)  # grown: taken again
    assert seq.block_table_snapshot() == (4, 5, 6)
    seq.block_table[-1] = 8  # replaced (copy-on-write): a new id, taken again
    seq.block_table_id = 9
    assert seq.block_table_snapshot() == (4, 5, 8)
    seq.block_table_id = 0  # set by hand, no id: always taken again
    seq.block_table[0] = 3
    assert seq.block_table_snapshot() == (3, 5, 8)
    seq.block_table[0] = 2
    assert seq.block_table_snapshot() == (2, 5, 8)


def test_a_chunk_records_its_table_as_a_tuple_with_its_id():
    seq = make_seq([1, 2, 3])
    seq.block_table, seq.block_table_id = [4], 3
    out = SchedulerOutput()
    out.add(seq, 3)
    chunk = out.chunks[0]
    assert chunk.block_table == (4,) and chunk.block_table_id == 3
    seq.block_table.append(5)
    assert chunk.block_table == (4,)
    assert ScheduledChunk("x", [1], 0, [1, 2], sample=False).block_table == (1, 2)


def test_the_prompt_tokens_each_chunk_predicts():
    seq = make_seq([10, 11, 12, 13, 14], prompt_logprobs=1)
    out = SchedulerOutput()
    out.add(seq, 2)  # rows 0, 1 predict positions 1, 2
    assert out.chunks[0].prompt_logprob_token_ids == [11, 12]
    seq.num_computed_tokens = 2
    out = SchedulerOutput()
    out.add(seq, 3)  # rows 2, 3 predict 13, 14; row 4 predicts the first output
    assert out.chunks[0].prompt_logprob_token_ids == [13, 14]
    assert out.chunks[0].sample
    plain = make_seq([10, 11, 12])
    out = SchedulerOutput()
    out.add(plain, 3)
    assert out.chunks[0].prompt_logprob_token_ids == []


def test_padding_is_counted_apart_from_the_rows_that_advance_requests():
    seq, other = make_seq([1, 2, 3]), make_seq([4, 5])
    out = SchedulerOutput()
    out.add(seq, 3)
    assert (out.wasted_ids, out.num_wasted_tokens) == ([], 0)
    out.add_padding(other, position=2, num_rows=2)
    out.add_padding(seq, position=3, num_rows=1)
    assert out.wasted_ids == [other.request_id, seq.request_id]
    assert out.num_wasted_tokens == 3
    assert out.num_rows == 6 and out.total_num_scheduled_tokens == 3
    assert [c.token_ids for c in out.chunks[1:]] == [[PAD_TOKEN_ID] * 2, [PAD_TOKEN_ID]]
    assert [(c.start_position, c.sample) for c in out.chunks[1:]] == [(2, False), (3, False)]


def test_a_chunk_past_the_known_ids_keeps_them_and_adds_a_placeholder_per_missing_token():
    seq = make_seq([1, 2, 3])
    seq.append_token(4, now=0.0)
    seq.num_computed_tokens = 2
    seq.num_output_placeholders = 1
    out = SchedulerOutput()
    out.add(seq, 3)
    assert out.chunks[0].token_ids == [3, 4, PLACEHOLDER_TOKEN_ID] and out.chunks[0].sample


def test_only_a_sampling_chunk_with_penalties_carries_the_token_ids():
    for params, num_new, carries in [
        ({}, 3, False),  # samples, no penalties
        ({"presence_penalty": 0.5}, 2, False),  # penalties, mid-prompt
        ({"presence_penalty": 0.5}, 3, True),
    ]:
        out = SchedulerOutput()
        out.add(make_seq([1, 2, 3], **params), num_new)
        chunk = out.chunks[0]
        assert (chunk.prompt_token_ids, chunk.output_token_ids) == (
            ([1, 2, 3], []) if carries else ([], [])
        )


def test_a_table_set_by_hand_without_an_id_is_taken_afresh_every_time():
    # Tests (and nothing else) set tables by hand; with no id the snapshot cannot know
    # the table changed in place, so it never reuses one.
    seq = make_seq([1, 2, 3])
    assert seq.block_table_id == 0 and seq.block_table_snapshot() == ()
    seq.block_table = [4, 5]
    assert seq.block_table_snapshot() == (4, 5)
    seq.block_table[0] = 7
    assert seq.block_table_snapshot() == (7, 5)
