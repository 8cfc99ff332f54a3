"""Static batching's rules on their own, with no model (end to end: test_static_policy.py).

A batch forms only when the previous one has ended; each member reserves a whole
``max_model_len`` region; the first step prefills every prompt padded to the longest;
then the batch decodes in lockstep, finished members burning one padding row per step.
"""

from __future__ import annotations

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler_output import PAD_TOKEN_ID
from minivllm.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.static_scheduler import StaticBatchScheduler

NEXT_TOKEN = 7


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=3, max_model_len=16):
    manager = KVCacheManager(num_blocks, block_size)
    return StaticBatchScheduler(
        manager, max_num_seqs=max_num_seqs, max_model_len=max_model_len, clock=lambda: 0.0
    )


def make_seq(request_id, prompt_len):
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(temperature=0))


def step(scheduler):
    """Schedule, pretend the model ran, append a token where a chunk reached the end."""
    out = scheduler.schedule()
    finishing = [
        s for s, n in zip(out.scheduled_seqs, num_new_tokens(out))
        if s.num_computed_tokens + n == s.num_tokens
    ]  # fmt: skip
    scheduler.update_from_output(out, ModelRunnerOutput())
    for seq in finishing:
        seq.append_token(NEXT_TOKEN, now=0.0)
    return out


def num_new_tokens(out):
    return [out.num_scheduled_tokens[s.request_id] for s in out.scheduled_seqs]


def padding_of(out):
    """(request id, first position, rows) of each padding chunk: computed, never sampled."""
    return [
        (c.request_id, c.start_position, len(c.token_ids))
        for c in out.chunks
        if not c.sample and set(c.token_ids) == {PAD_TOKEN_ID}
    ]


def finish(scheduler, seq, reason=FinishReason.LENGTH, stop_reason=None):
    scheduler.finish_requests(seq.request_id, reason, stop_reason)


def test_the_first_step_prefills_every_prompt_padded_to_the_longest():
    scheduler = make_scheduler()
    a, b, c = make_seq("a", 5), make_seq("b", 2), make_seq("c", 3)
    for seq in (a, b, c):
        scheduler.add_request(seq)
    out = step(scheduler)
    assert out.scheduled_seqs == [a, b, c] and num_new_tokens(out) == [5, 2, 3]
    assert padding_of(out) == [("b", 2, 3), ("c", 3, 2)]
    assert out.num_wasted_tokens == 5
    assert all(s.status is SequenceStatus.RUNNING for s in (a, b, c))
    assert scheduler.num_batches == 1 and scheduler.num_preemptions == 0


def test_padding_goes_to_the_padded_members_own_region_and_the_longest_gets_none():
    scheduler = make_scheduler()
    a, b, c = make_seq("a", 5), make_seq("b", 2), make_seq("c", 3)
    for seq in (a, b, c):
        scheduler.add_request(seq)
    scheduler.clock = lambda: 3.0
    out = step(scheduler)
    assert [chunk.request_id for chunk in out.chunks] == ["a", "b", "b", "c", "c"]
    tables = [list(chunk.block_table) for chunk in out.chunks]
    assert tables == [a.block_table, b.block_table, b.block_table, c.block_table, c.block_table]
    assert [s.metrics.first_scheduled_time for s in (a, b, c)] == [3.0, 3.0, 3.0]


def test_every_member_reserves_a_whole_max_model_len_region():
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_model_len=16)
    assert scheduler.blocks_per_request == 4
    for name in "abc":
        scheduler.add_request(make_seq(name, 2))
    out = step(scheduler)
    assert [len(s.block_table) for s in out.scheduled_seqs] == [4, 4]  # 10 blocks: two regions
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    assert scheduler.kv_cache_manager.num_free_blocks == 2


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_seq(name, 2))
    assert [s.request_id for s in step(scheduler).scheduled_seqs] == ["a", "b"]


def test_nobody_waits_preempted_and_nothing_is_drafted():
    """The counters the engine's per-step snapshot reads stay zero: every member owns its
    region, so none is preempted, and a static batch carries no draft tokens."""
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    for name in "ab":
        scheduler.add_request(make_seq(name, 2))
    step(scheduler)
    assert list(scheduler.waiting) == [scheduler.requests["b"]]
    assert scheduler.num_waiting_preempted == 0 and scheduler.num_preemptions == 0
    assert not hasattr(scheduler, "spec_decoding_stats")  # the engine reports None


def test_lockstep_decodes_pad_the_finished_members_until_the_batch_ends():
    scheduler = make_scheduler(max_model_len=16)
    a, b = make_seq("a", 3), make_seq("b", 5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    late = make_seq("late", 2)
    scheduler.add_request(late)

    out = step(scheduler)  # decode 1: both real
    assert out.scheduled_seqs == [a, b] and num_new_tokens(out) == [1, 1] and padding_of(out) == []
    finish(scheduler, a, FinishReason.LENGTH)
    assert scheduler.running == [a, b] and a.block_table  # a keeps its slot and region
    assert scheduler.has_unfinished_requests()

    out = step(scheduler)  # decode 2: a is done, so a padding row where its token would be
    assert out.scheduled_seqs == [b] and padding_of(out) == [("a", 3 + 2 - 1, 1)]
    out = step(scheduler)
    assert out.scheduled_seqs == [b] and padding_of(out) == [("a", 3 + 3 - 1, 1)]
    assert b.num_computed_tokens == 5 + 3 and b.num_tokens == 5 + 4  # one token per step
    assert scheduler.num_decode_steps == 3
    assert late.status is SequenceStatus.WAITING  # nobody joins a running batch

    finish(scheduler, b, FinishReason.LENGTH)  # the batch ends: regions go back
    assert scheduler.running == [] and a.block_table == [] and b.block_table == []
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    out = step(scheduler)
    assert out.scheduled_seqs == [late] and scheduler.num_batches == 2
    assert scheduler.num_decode_steps == 0


def test_a_padding_row_stays_inside_the_region():
    """A member finished long ago: its would-be position is capped at max_model_len - 1."""
    scheduler = make_scheduler(max_model_len=8, block_size=4)
    a, b = make_seq("a", 6), make_seq("b", 1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    finish(scheduler, a, FinishReason.LENGTH)
    positions = [padding_of(step(scheduler))[0][1] for _ in range(4)]
    assert positions == [6, 7, 7, 7]


def test_aborting_a_waiting_request_removes_it():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", 2), make_seq("b", 2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    finish(scheduler, b, FinishReason.ABORT)
    assert list(scheduler.waiting) == [] and b.is_finished
    assert scheduler.has_unfinished_requests()  # a still runs
    finish(scheduler, a, FinishReason.ABORT)
    assert not scheduler.has_unfinished_requests()
    assert step(scheduler).is_empty


def test_nothing_to_schedule_when_no_region_fits():
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_model_len=16)
    scheduler.add_request(make_seq("a", 2))
    out = step(scheduler)
    assert out.is_empty and scheduler.num_batches == 0
    assert scheduler.has_unfinished_requests()


def test_finish_records_the_reason_time_and_stop_reason():
    scheduler = make_scheduler()
    a, b = make_seq("a", 2), make_seq("b", 2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    scheduler.clock = lambda: 3.5
    finish(scheduler, a, FinishReason.STOP, stop_reason="###")
    assert (a.finish_reason, a.stop_reason, a.metrics.finished_time) == (
        FinishReason.STOP,
        "###",
        3.5,
    )
    assert a.is_finished and not b.is_finished


def test_a_pool_of_exactly_two_regions_takes_two_members():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=16)
    for name in "abc":
        scheduler.add_request(make_seq(name, 2))
    assert [s.request_id for s in step(scheduler).scheduled_seqs] == ["a", "b"]
    assert scheduler.kv_cache_manager.num_free_blocks == 0
