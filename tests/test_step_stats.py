"""`StepStats.capture` (minivllm/stats.py) on hand-made engine state, without a model:
each field is what the scheduler and the KV-cache manager say at capture time, and the
snapshot does not move when they count on afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm.config import EngineConfig
from minivllm.kv_cache_manager import PrefixCacheStats
from minivllm.spec_decode import SpecDecodingStats
from minivllm.stats import EngineStats, StepStats, TokenCounts


def engine_state():
    running = [SimpleNamespace(num_computed_tokens=n) for n in (5, 17, 0)]
    scheduler = SimpleNamespace(
        running=running,
        waiting=[object()] * 7,  # 3 of them preempted
        num_waiting_preempted=3,
        num_preemptions=11,
    )
    kv = SimpleNamespace(
        num_blocks=40, num_free_blocks=30, prefix_cache_stats=PrefixCacheStats(100, 25)
    )
    return scheduler, kv


def step_that_ran():
    """A step as SchedulerOutput reports it: a prefill, two decodes, a padding row."""
    return SimpleNamespace(
        num_prefill_tokens=12,
        num_decode_tokens=2,
        num_wasted_tokens=1,
        prefill_ids=["p"],
        decode_ids=["d1", "d2"],
        wasted_ids=["w"],
        preempted=[SimpleNamespace(request_id="gone")],
    )


def test_capture_after_a_step_reports_what_ran_and_the_state_after_it():
    scheduler, kv = engine_state()
    spec = SpecDecodingStats(
        num_spec_tokens=3,
        num_drafts=2,
        num_draft_tokens=5,
        num_accepted_tokens=4,
        num_accepted_tokens_per_pos=[2, 1, 1],
    )
    stats = StepStats.capture(scheduler, kv, spec, step_that_ran(), 1.5, 2.25, 9, 4)
    assert (stats.start_time, stats.end_time) == (1.5, 2.25)
    assert (stats.num_prefill_tokens, stats.num_decode_tokens) == (12, 2)
    assert stats.num_padding_tokens == 1 and stats.num_computed_slots == 15
    assert (stats.prefill_ids, stats.decode_ids, stats.padding_ids) == (["p"], ["d1", "d2"], ["w"])
    assert stats.preempted_ids == ["gone"]
    assert (stats.num_running, stats.num_waiting, stats.num_preempted) == (3, 4, 3)
    assert (stats.num_kv_blocks_used, stats.num_kv_blocks) == (10, 40)
    assert stats.num_kv_tokens_stored == 22
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (9, 4)
    assert stats.num_preemptions_total == 11
    assert stats.prefix_cache == PrefixCacheStats(100, 25)
    assert stats.spec_decoding == spec
    assert stats.kv_cache_usage == pytest.approx(0.25)


def test_the_snapshot_stays_put_when_the_engine_counts_on():
    scheduler, kv = engine_state()
    spec = SpecDecodingStats(num_spec_tokens=2, num_accepted_tokens_per_pos=[1, 0])
    stats = StepStats.capture(scheduler, kv, spec, step_that_ran())
    kv.prefix_cache_stats.num_hit_tokens += 50
    spec.num_drafts += 1
    spec.num_accepted_tokens_per_pos[0] += 1
    assert stats.prefix_cache == PrefixCacheStats(100, 25)
    assert stats.spec_decoding.num_drafts == 0
    assert stats.spec_decoding.num_accepted_tokens_per_pos == [1, 0]


def test_capture_between_steps_reports_nothing_ran():
    scheduler, kv = engine_state()
    stats = StepStats.capture(scheduler, kv, None)
    assert (stats.start_time, stats.end_time) == (0.0, 0.0)
    assert (stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_padding_tokens) == (
        0, 0, 0
    )  # fmt: skip
    assert stats.num_computed_slots == 0
    assert stats.prefill_ids == stats.decode_ids == stats.padding_ids == stats.preempted_ids == []
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (0, 0)
    assert stats.spec_decoding is None
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (3, 4, 10)


def test_a_step_built_by_hand_starts_its_counters_at_zero():
    stats = StepStats(0.0, 1.0, 3, 1, 0, 2, 0, 0, 4, 30)
    assert stats.prefill_ids == stats.decode_ids == stats.padding_ids == []
    assert stats.preempted_ids == []
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (0, 0)
    assert (stats.num_kv_blocks, stats.num_preemptions_total) == (0, 0)
    assert stats.prefix_cache == PrefixCacheStats()
    assert stats.spec_decoding is None
    assert stats.kv_cache_usage == 0.0  # no pool size known: not a division by zero
    other = StepStats(0.0, 1.0, 3, 1, 0, 2, 0, 0, 4, 30)
    other.prefill_ids.append("x")
    assert stats.prefill_ids == []  # each snapshot its own lists


# --- EngineStats and TokenCounts: what the engine records of its steps -------------------


def test_token_counts_take_a_prompt_once_when_its_first_tokens_are_kept():
    counts = TokenCounts()
    first = SimpleNamespace(num_output_tokens=2, num_prompt_tokens=9)  # 2 kept, its first
    counts.add(first, 2)
    later = SimpleNamespace(num_output_tokens=5, num_prompt_tokens=7)  # 1 more of 5
    counts.add(later, 1)
    mid_prompt = SimpleNamespace(num_output_tokens=0, num_prompt_tokens=4)  # nothing kept
    counts.add(mid_prompt, 0)
    assert (counts.num_prompt_tokens, counts.num_generation_tokens) == (9, 3)
    counts.add(SimpleNamespace(num_output_tokens=1, num_prompt_tokens=6), 1)  # a second one
    assert (counts.num_prompt_tokens, counts.num_generation_tokens) == (15, 4)  # summed


def make_engine_stats(spec_decoding=None):
    scheduler, kv = engine_state()
    if spec_decoding is not None:
        scheduler.spec_decoding_stats = spec_decoding
    times = iter([10.0, 11.0, 12.0, 13.0])
    return EngineStats(scheduler, kv, clock=lambda: next(times))


def test_engine_stats_record_steps_only_between_record_and_take():
    stats = make_engine_stats()
    assert stats.last is None
    stats.step_done(step_that_ran(), 9.5, TokenCounts(4, 2))  # not recording yet
    first = stats.last
    assert (first.start_time, first.end_time) == (9.5, 10.0)
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (4, 2)
    # What the step ran, as its scheduler output says (not an idle snapshot's zeros).
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (12, 2)
    assert (first.decode_ids, first.preempted_ids) == (["d1", "d2"], ["gone"])
    with pytest.raises(RuntimeError, match=r"^take_step_stats\(\) without record_steps\(\) first$"):
        stats.take_step_stats()
    stats.record_steps()
    stats.step_done(step_that_ran(), 10.5, TokenCounts())
    stats.step_done(step_that_ran(), 11.5, TokenCounts(0, 1))
    recorded = stats.take_step_stats()
    assert [s.start_time for s in recorded] == [10.5, 11.5]
    assert [s.end_time for s in recorded] == [11.0, 12.0]
    assert recorded[-1] is stats.last and stats.recorded is None  # recording stopped
    stats.step_done(step_that_ran(), 12.5, TokenCounts())
    with pytest.raises(RuntimeError):
        stats.take_step_stats()


def test_engine_stats_between_steps_and_as_a_dict():
    plain = make_engine_stats()
    now = plain.make_stats()
    assert (now.start_time, now.end_time) == (10.0, 10.0)  # one clock read
    assert now.num_prefill_tokens == now.num_generation_tokens == 0
    assert plain.spec_decoding is None and now.spec_decoding is None
    spec = SpecDecodingStats(2)
    spec.observe_draft(2, 1)
    drafting = make_engine_stats(spec)
    assert drafting.spec_decoding is spec
    config = EngineConfig(max_num_seqs=3)
    as_dict = drafting.as_dict(config)
    assert as_dict["num_running"] == 3 and as_dict["num_waiting"] == 4
    assert as_dict["num_preempted"] == 3 and as_dict["num_free_blocks"] == 30
    assert as_dict["num_kv_blocks"] == 40 and as_dict["num_preemptions_total"] == 11
    assert (as_dict["prefix_cache_query_tokens"], as_dict["prefix_cache_hit_tokens"]) == (100, 25)
    assert as_dict["prefix_cache_hit_rate"] == 0.25
    assert as_dict["spec_decode_num_drafts"] == 1 and as_dict["config"]["max_num_seqs"] == 3
    assert "spec_decode_num_drafts" not in plain.as_dict(config)
