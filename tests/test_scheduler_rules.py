"""Every rule the continuous scheduler promises, each reached on purpose, with no model.

The randomized state machine in test_scheduler_invariants.py checks that nothing is ever
lost; these tests check the *policy*, one situation per rule, with hand-built sequences, a
real `KVCacheManager` and a pool sized so the situation must happen:

- running sequences spend the token budget before any waiting one is looked at;
- waiting sequences are admitted first come first served, a preempted one first of all;
- the newest running sequence is the one preempted, and nobody is admitted in that step;
- a prefix-cache hit is counted once, at the first admission, never overwritten later.

`step` plays the engine: schedule, pretend the model ran, and append a token to every
sequence whose chunk reached its end (what `ModelRunner` samples).
"""

from __future__ import annotations

import pytest

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus

NEXT_TOKEN = 7  # what the pretend model samples


def make_scheduler(num_blocks, block_size=4, max_num_seqs=8, budget=64, prefix_caching=False):
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(
        manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, clock=lambda: 0.0
    )


def make_seq(request_id: str, prompt: list[int] | int) -> Sequence:
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Sequence(request_id, prompt, SamplingParams(temperature=0))


def add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add_request(seq)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, compute, sample where a chunk ends."""
    out = scheduler.schedule()
    finishing = [
        seq
        for seq, n in zip(out.scheduled_seqs, num_new_tokens(out))
        if seq.num_computed_tokens + n == seq.num_tokens
    ]
    scheduler.update_from_output(out, ModelRunnerOutput())
    for seq in finishing:
        seq.append_token(NEXT_TOKEN, now=0.0)
    return out


def finish(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.finish_requests(seq.request_id, FinishReason.STOP)


def num_new_tokens(out: SchedulerOutput) -> list[int]:
    return [out.num_scheduled_tokens[seq.request_id] for seq in out.scheduled_seqs]


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return dict(zip([seq.request_id for seq in out.scheduled_seqs], num_new_tokens(out)))


# --- the token budget --------------------------------------------------------------------------


def test_running_decodes_spend_the_budget_before_waiting_prefills():
    scheduler = make_scheduler(num_blocks=32, budget=10)
    a, b = make_seq("a", 6), make_seq("b", 6)
    add(scheduler, a, b)
    assert scheduled(step(scheduler)) == {"a": 6, "b": 4}  # b's prompt is chunked
    add(scheduler, make_seq("c", 20))
    out = step(scheduler)
    # a decodes (1), b finishes its prompt (2), and only then c gets what is left (7).
    assert scheduled(out) == {"a": 1, "b": 2, "c": 7}
    assert [out.is_prefill[s.request_id] for s in out.scheduled_seqs] == [False, True, True]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 9)
    assert out.total_num_scheduled_tokens == 10


def test_a_running_prefill_chunk_takes_the_budget_before_an_earlier_waiting_request():
    """Order is running first, not arrival first: b is running (mid-prompt) while the
    waiting c must wait for what b leaves over."""
    scheduler = make_scheduler(num_blocks=32, budget=8)
    add(scheduler, make_seq("b", 20))
    step(scheduler)  # b: 8 of 20 prompt tokens
    add(scheduler, make_seq("c", 3))
    assert scheduled(step(scheduler)) == {"b": 8}
    assert scheduled(step(scheduler)) == {"b": 4, "c": 3}


def test_the_budget_caps_the_running_sequences_too():
    scheduler = make_scheduler(num_blocks=32, budget=5)
    add(scheduler, make_seq("a", 3), make_seq("b", 9))
    assert scheduled(step(scheduler)) == {"a": 3, "b": 2}
    assert scheduled(step(scheduler)) == {"a": 1, "b": 4}
    assert scheduled(step(scheduler)) == {"a": 1, "b": 3}
    assert scheduled(step(scheduler)) == {"a": 1, "b": 1}


def test_max_num_seqs_caps_admission():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=2)
    add(scheduler, make_seq("a", 2), make_seq("b", 2), make_seq("c", 2))
    assert scheduled(step(scheduler)) == {"a": 2, "b": 2}
    assert list(scheduler.waiting)[0].request_id == "c"
    finish(scheduler, scheduler.running[0])
    assert scheduled(step(scheduler)) == {"b": 1, "c": 2}


# --- admission: first come first served ----------------------------------------------------


def test_the_head_of_the_queue_is_never_overtaken():
    """b does not fit, c would: c still waits behind b (no skipping ahead)."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = make_seq("a", 8), make_seq("b", 12), make_seq("c", 4)
    add(scheduler, a, b, c)
    assert scheduled(step(scheduler)) == {"a": 8}
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2
    finish(scheduler, a)
    assert list(scheduled(step(scheduler))) == ["b", "c"]


def test_the_newest_running_sequence_is_preempted_and_readmitted_before_later_arrivals():
    """A pool of 4 blocks (16 tokens): a and b fill it; when a needs a new block, b (the
    newest) is preempted, goes to the *front* of the queue, and comes back before c."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    add(scheduler, a, b)
    assert scheduled(step(scheduler)) == {"a": 8, "b": 8}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    c = make_seq("c", 2)
    add(scheduler, c)

    out = step(scheduler)  # a's 9th token needs a third block: b must go
    assert out.preempted == [b]
    assert scheduled(out) == {"a": 1}
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_tokens == 9  # its output is kept
    assert b.metrics.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_waiting_preempted == 1  # b, not c (what the stats report)

    finish(scheduler, a)
    out = step(scheduler)
    assert scheduled(out) == {"b": 9, "c": 2}  # b recomputes prompt + output, then c
    assert [s.request_id for s in scheduler.running] == ["b", "c"]
    assert scheduler.num_waiting_preempted == 0


def test_no_admission_in_a_step_that_preempted():
    """The preempting step frees blocks, and the waiting head (the victim itself, whose
    next chunk is only as large as the budget left) would fit into them; it is still not
    admitted: the pool is full, so it would be the next victim."""
    scheduler = make_scheduler(num_blocks=5, block_size=2, budget=3)
    a, b = make_seq("a", 2), make_seq("b", 6)
    add(scheduler, a, b)
    for expected in ({"a": 2, "b": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2}):
        assert scheduled(step(scheduler)) == expected  # b's prompt in chunks: 3 blocks
    out = step(scheduler)  # a needs a third block and none is free: b goes
    assert out.preempted == [b] and scheduled(out) == {"a": 1}
    # 2 blocks are free now, and b's next chunk (2 tokens, the budget left) needs 1.
    assert scheduler.kv_cache_manager.num_free_blocks == 2
    assert list(scheduler.waiting) == [b] and b.block_table == []
    out = step(scheduler)  # the next step readmits it
    assert out.preempted == [] and scheduled(out) == {"a": 1, "b": 2}


def test_preemption_evicts_from_the_newest_until_the_oldest_fits():
    """Three running sequences and a full pool: the oldest needs a block, so the newest is
    evicted; if that were not enough the next newest would follow, never the oldest."""
    scheduler = make_scheduler(num_blocks=6, block_size=2)
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    add(scheduler, a, b, c)
    step(scheduler)
    out = step(scheduler)  # a (5 tokens) needs a third block; c goes; then b needs one
    assert out.preempted == [c]
    assert scheduled(out) == {"a": 1, "b": 1}
    out = step(scheduler)  # a and b both fit in their third blocks
    assert out.preempted == []
    out = step(scheduler)  # both need a fourth block: the pool has 1 free (6 - 3 - 3 + 0)
    assert out.preempted == [b]
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]
    # Both wait as preempted (what the stats report), counted one by one as they came.
    assert scheduler.num_waiting_preempted == 2


def test_a_sequence_that_cannot_fit_even_alone_preempts_itself():
    """The oldest running sequence is the last one left: it is preempted rather than the
    scheduler looping forever, and the step schedules nothing."""
    scheduler = make_scheduler(num_blocks=2, block_size=2)
    a = make_seq("a", 4)
    add(scheduler, a)
    step(scheduler)
    out = step(scheduler)  # a needs a third block; the pool has two
    assert out.preempted == [a] and out.is_empty
    assert list(scheduler.waiting) == [a] and scheduler.running == []


# --- prefix-cache accounting --------------------------------------------------------------


def test_num_cached_tokens_is_the_first_admissions_hit_and_survives_readmission():
    """b is admitted with a 4-token hit on a's prompt. Preempted, it is readmitted with a
    bigger hit on its own old blocks; the count it reports stays the first one."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, prefix_caching=True)
    shared = [11, 12, 13, 14]
    a = make_seq("a", shared + [1, 2, 3, 4, 5])
    add(scheduler, a)
    step(scheduler)  # a: 9 tokens in 3 blocks, its first block cached
    b = make_seq("b", shared + [6, 7, 8, 9, 10, 20])
    add(scheduler, b)
    out = step(scheduler)
    assert scheduled(out) == {"a": 1, "b": 6}  # b shares a's first block: 4 tokens saved
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 10
    assert b.block_table[0] == a.block_table[0]

    for _ in range(2):  # both decode inside their third blocks, filling them
        assert step(scheduler).preempted == []
    out = step(scheduler)  # both need a fourth block; one is free: a takes it, b goes
    assert out.preempted == [b]
    assert (b.num_tokens, b.num_cached_tokens) == (13, 4)
    finish(scheduler, a)

    out = step(scheduler)
    # Readmitted: b's three full blocks (12 tokens) are still cached; 1 token to compute.
    assert scheduled(out) == {"b": 1}
    assert b.num_computed_tokens == 13
    assert b.num_cached_tokens == 4  # still the first admission's hit, not 12
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.num_hit_tokens == 4 + 12
    assert stats.num_queried_tokens == 9 + 10 + 13


def test_the_first_admission_stamps_first_scheduled_time_and_a_readmission_keeps_it():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    add(scheduler, a, b)
    scheduler.clock = lambda: 1.0
    step(scheduler)
    assert (a.metrics.first_scheduled_time, b.metrics.first_scheduled_time) == (1.0, 1.0)
    assert step(scheduler).preempted == [b]
    finish(scheduler, a)
    scheduler.clock = lambda: 5.0
    assert scheduled(step(scheduler)) == {"b": 9}
    assert b.metrics.first_scheduled_time == 1.0


def test_a_readmission_starts_computing_after_its_cache_hit():
    """a is preempted with two full cached blocks; readmitted, it computes only the rest."""
    scheduler = make_scheduler(num_blocks=4, block_size=2, prefix_caching=True)
    b, a = make_seq("b", [9, 9]), make_seq("a", [1, 2, 3, 4, 5])
    add(scheduler, b, a)
    step(scheduler)  # b: 1 block, a: 3 blocks; the pool is full
    out = step(scheduler)  # b needs a second block: a, the newest, is preempted
    assert out.preempted == [a] and a.num_tokens == 6
    finish(scheduler, b)
    out = step(scheduler)
    assert scheduled(out) == {"a": 2}  # [1 2] [3 4] hit; [5 7] is computed again
    assert a.num_computed_tokens == 6 and a.num_cached_tokens == 0


@pytest.mark.parametrize("prompt_len, expected_hit", [(7, 4), (8, 4), (9, 8)])
def test_the_prefix_hit_leaves_at_least_the_last_token_to_compute(prompt_len, expected_hit):
    """Capped at len - 1 tokens, in whole blocks: a prompt of exactly two cached blocks
    recomputes its second block, one token more hits both."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, prefix_caching=True)
    first = make_seq("first", list(range(1, 13)))
    add(scheduler, first)
    step(scheduler)
    again = make_seq("again", list(range(1, prompt_len + 1)))
    add(scheduler, again)
    out = step(scheduler)
    assert scheduled(out)["again"] == prompt_len - expected_hit
    assert again.num_cached_tokens == expected_hit


def test_finishing_takes_a_request_out_of_whichever_queue_it_is_in():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_seq("a", 4), make_seq("b", 4)
    add(scheduler, a, b)
    step(scheduler)
    assert scheduler.has_unfinished_requests()
    finish(scheduler, b)  # still waiting (an abort)
    assert list(scheduler.waiting) == [] and b.is_finished and b.block_table == []
    assert b.finish_reason is FinishReason.STOP and b.metrics.finished_time == 0.0
    assert scheduler.has_unfinished_requests()  # a still runs
    finish(scheduler, a)  # running: its blocks go back at once
    assert scheduler.running == [] and a.block_table == []
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()
    assert step(scheduler).is_empty


def test_a_preempted_request_can_be_finished_while_it_waits():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    add(scheduler, a, b)
    step(scheduler)
    assert step(scheduler).preempted == [b]
    assert scheduler.num_waiting_preempted == 1
    finish(scheduler, b)
    assert list(scheduler.waiting) == [] and b.is_finished
    assert scheduler.num_waiting_preempted == 0
    assert scheduled(step(scheduler)) == {"a": 1}


def test_every_preemption_is_counted_per_request_and_in_total():
    """b is the newest running request twice, and twice the victim."""
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a, d, b = make_seq("a", 2), make_seq("d", 2), make_seq("b", 2)
    add(scheduler, a, d, b)
    step(scheduler)  # one block each, one free
    assert step(scheduler).preempted == [b]  # a takes the free block, d takes b's
    finish(scheduler, a)
    out = step(scheduler)  # b is readmitted into a's blocks
    assert scheduled(out) == {"d": 1, "b": 3}
    assert step(scheduler).preempted == [b]  # d needs a third block
    assert b.metrics.num_preemptions == 2 and d.metrics.num_preemptions == 0
    assert scheduler.num_preemptions == 2


def test_finish_records_the_reason_time_and_stop_reason():
    scheduler = make_scheduler(num_blocks=4)
    a = make_seq("a", 2)
    add(scheduler, a)
    step(scheduler)
    scheduler.clock = lambda: 2.5
    scheduler.finish_requests("a", FinishReason.STOP, stop_reason="###")
    assert (a.finish_reason, a.stop_reason, a.metrics.finished_time) == (
        FinishReason.STOP,
        "###",
        2.5,
    )


def test_a_running_request_the_budget_does_not_reach_is_not_in_the_step():
    scheduler = make_scheduler(num_blocks=16, budget=3)
    add(scheduler, make_seq("a", 1), make_seq("b", 1), make_seq("c", 1))
    assert scheduled(step(scheduler)) == {"a": 1, "b": 1, "c": 1}
    scheduler.max_num_batched_tokens = 2  # a smaller budget from now on
    out = step(scheduler)
    assert scheduled(out) == {"a": 1, "b": 1}  # c waits its turn; no empty chunk for it
    assert all(n >= 1 for n in num_new_tokens(out))


# --- beam search's hooks: forks, idle beams, copy-on-write -----------------------------------


def computed(scheduler: Scheduler, seq: Sequence) -> None:
    """Schedule and compute ``seq``'s uncomputed tokens, appending nothing: a beam that has
    reported its row and now waits, idle, for its siblings."""
    out = scheduler.schedule()
    assert seq in out.scheduled_seqs
    scheduler.update_from_output(out, ModelRunnerOutput())
    assert seq.num_uncomputed_tokens == 0


def fork_of(parent: Sequence, request_id: str, token: int) -> Sequence:
    child = make_seq(request_id, parent.prompt_token_ids)
    child.token_ids = parent.token_ids[: parent.num_computed_tokens] + [token]
    return child


def test_a_fork_of_a_running_beam_shares_its_blocks_and_runs_at_once():
    scheduler = make_scheduler(num_blocks=8)
    clock = iter([1.0, 2.0, 3.0])
    scheduler.clock = lambda: next(clock)
    parent = make_seq("a", 6)
    add(scheduler, parent)
    computed(scheduler, parent)  # admitted at 1.0
    child = fork_of(parent, "b", 9)
    scheduler.fork_request(parent, child)
    assert list(scheduler.running) == [parent, child] and not scheduler.waiting
    assert scheduler.requests["b"] is child and child.status is SequenceStatus.RUNNING
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert child.metrics.first_scheduled_time == 2.0
    assert scheduler.kv_cache_manager.allocator.ref_counts[parent.block_table[0]] == 2


@pytest.mark.parametrize("why", ["parent preempted", "batch full", "no room for copies"])
def test_a_fork_that_cannot_share_now_waits_at_the_back_of_the_queue(why):
    scheduler = make_scheduler(num_blocks=2 if why == "no room for copies" else 8)
    if why == "batch full":
        scheduler.max_num_seqs = 1
    if why == "no room for copies":
        scheduler.kv_cache_manager.share_forked_blocks = False
    parent, other = make_seq("a", 6), make_seq("z", 3)
    add(scheduler, parent)
    computed(scheduler, parent)
    if why == "parent preempted":
        scheduler._preempt(scheduler.running.pop())
    add(scheduler, other)
    child = fork_of(parent, "b", 9)
    scheduler.fork_request(parent, child)
    assert scheduler.requests["b"] is child and scheduler.waiting[-1] is child
    assert child not in scheduler.running and child.block_table == []
    assert child.status is SequenceStatus.WAITING and child.num_computed_tokens == 0


def test_a_running_beam_with_nothing_to_compute_is_skipped_not_preempted():
    scheduler = make_scheduler(num_blocks=8)
    a, b = make_seq("a", 4), make_seq("b", 4)
    add(scheduler, a, b)
    step(scheduler)
    b.token_ids.pop()  # b waits idle (its row reported), a has its next token to compute
    b.num_computed_tokens = b.num_tokens
    b_before = list(b.block_table)
    out = step(scheduler)
    assert scheduled(out) == {"a": 1} and out.preempted == []
    assert list(scheduler.running) == [a, b] and b.block_table == b_before


def test_an_idle_beam_does_not_stop_the_running_after_it():
    scheduler = make_scheduler(num_blocks=8)
    a, b = make_seq("a", 4), make_seq("b", 4)
    add(scheduler, a, b)
    step(scheduler)  # both get a token to compute
    a.token_ids.pop()  # a, the oldest, waits idle
    out = step(scheduler)
    assert scheduled(out) == {"b": 1}


def test_idle_beams_are_preempted_newest_first_until_the_head_of_the_queue_is_admitted():
    # Every running sequence is a beam waiting idle; the head of the queue needs 2 blocks,
    # the pool has none left: the newest beams give theirs back, one at a time.
    scheduler = make_scheduler(num_blocks=6, budget=64)
    beams = [make_seq(f"b{i}", 8) for i in range(3)]  # 2 blocks each
    add(scheduler, *beams)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    head = make_seq("h", 5)
    add(scheduler, head)
    later = make_seq("l", 1)
    add(scheduler, later)
    out = scheduler.schedule()
    assert out.preempted == [beams[2]] and scheduled(out) == {"h": 5}
    assert list(scheduler.running) == [beams[0], beams[1], head]
    # The preempted beam goes to the back of the queue, behind later arrivals.
    assert list(scheduler.waiting) == [later, beams[2]]
    assert beams[2].status is SequenceStatus.PREEMPTED and beams[2].block_table == []
    assert scheduler.num_waiting_preempted == 1 and scheduler.num_preemptions == 1


def test_several_idle_beams_go_back_oldest_first_behind_the_queue():
    scheduler = make_scheduler(num_blocks=6, budget=64)
    beams = [make_seq(f"b{i}", 8) for i in range(3)]
    add(scheduler, *beams)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    head = make_seq("h", 13)  # 4 blocks: two beams must go
    add(scheduler, head)
    out = scheduler.schedule()
    assert out.preempted == [beams[2], beams[1]] and scheduled(out) == {"h": 13}
    assert list(scheduler.waiting) == [beams[1], beams[2]]
    assert list(scheduler.running) == [beams[0], head]


def test_idle_beams_are_not_preempted_while_anything_runs():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    beam, busy = make_seq("b", 8), make_seq("c", 7)
    add(scheduler, beam, busy)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    busy.append_token(NEXT_TOKEN, now=0.0)
    add(scheduler, make_seq("h", 5))
    out = scheduler.schedule()
    assert scheduled(out) == {"c": 1} and out.preempted == []


def test_copies_travel_with_the_next_step_that_runs():
    scheduler = make_scheduler(num_blocks=8)
    parent = make_seq("a", 6)  # 1 full block and a partial one
    add(scheduler, parent)
    computed(scheduler, parent)
    child = fork_of(parent, "b", 9)
    parent.append_token(8, now=0.0)
    scheduler.fork_request(parent, child)
    shared = parent.block_table[1]
    out = scheduler.schedule()
    assert scheduled(out) == {"a": 1, "b": 1}
    # The parent writes first: it gets the copy, the child keeps the shared block alone.
    assert out.blocks_to_copy == [(shared, parent.block_table[1])]
    assert child.block_table[1] == shared and parent.block_table[1] != shared
    scheduler.update_from_output(out, ModelRunnerOutput())
    assert scheduler.schedule().blocks_to_copy == []


def test_an_empty_step_keeps_its_copies_for_the_next():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.kv_cache_manager.blocks_to_copy.append((1, 2))
    out = scheduler.schedule()
    assert out.is_empty and out.blocks_to_copy == []
    add(scheduler, make_seq("a", 3))
    assert scheduler.schedule().blocks_to_copy == [(1, 2)]


def test_idle_beams_with_nobody_waiting_make_an_empty_step_and_keep_their_blocks():
    scheduler = make_scheduler(num_blocks=6)
    beams = [make_seq(f"b{i}", 5) for i in range(2)]
    add(scheduler, *beams)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput())
    tables = [list(b.block_table) for b in beams]
    out = scheduler.schedule()
    assert out.is_empty and out.preempted == [] and not scheduler.waiting
    assert list(scheduler.running) == beams and [b.block_table for b in beams] == tables
    assert scheduler.num_preemptions == 0
