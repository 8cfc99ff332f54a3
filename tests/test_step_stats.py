"""`StepStats.capture` (minivllm/stats.py) on hand-made engine state, without a model:
each field is what the scheduler and the KV-cache manager say at capture time, and the
snapshot does not move when they count on afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm.kv_cache_manager import PrefixCacheStats
from minivllm.spec_decode import SpecDecodingStats
from minivllm.stats import StepStats


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
