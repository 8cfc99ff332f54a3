"""The block-table manager on its own: how many blocks a step takes, chained block hashes,
and what a prefix-cache lookup may return. (End-to-end prefix caching: test_prefix_caching.)"""

from __future__ import annotations

import pytest

from minivllm.kv_cache_manager import KVCacheManager, cdiv, hash_block_tokens
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, list(token_ids), SamplingParams())


def compute(manager, seq, num_tokens, computed_blocks=None):
    """One scheduler step + model step for ``seq`` (see test_prefix_caching.compute)."""
    assert manager.allocate_slots(seq, num_tokens, computed_blocks)
    seq.num_computed_tokens += len(computed_blocks or []) * manager.block_size + num_tokens
    manager.cache_full_blocks(seq)


def test_cdiv_rounds_up():
    assert [cdiv(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_rejects_a_block_size_below_one():
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        KVCacheManager(num_blocks=4, block_size=0)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_a_growing_sequence_takes_one_block_each_time_it_crosses_a_boundary(block_size):
    manager = KVCacheManager(num_blocks=32, block_size=block_size)
    seq = make_seq([1, 2])
    compute(manager, seq, 2)
    for n in range(3, 12):
        seq.token_ids.append(n)
        free_before = manager.num_free_blocks
        compute(manager, seq, 1)
        took = free_before - manager.num_free_blocks
        assert took == (1 if (n - 1) % block_size == 0 else 0), n
        assert len(seq.block_table) == cdiv(n, block_size)
    assert manager.num_blocks == 32
    assert manager.num_blocks_needed(9) == cdiv(9, block_size)


def test_allocate_slots_fits_exactly_or_refuses_taking_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    exact = make_seq(range(12), "exact")
    assert manager.allocate_slots(exact, 12, [])
    assert manager.num_free_blocks == 0 and len(exact.block_table) == 3
    manager.free(exact)
    assert exact.block_table == [] and manager.num_free_blocks == 3
    too_big = make_seq(range(13), "too_big")
    assert not manager.allocate_slots(too_big, 13, [])
    assert too_big.block_table == [] and manager.num_free_blocks == 3
    assert manager.allocator.ref_counts == [0, 0, 0]


def test_admitting_a_sequence_that_still_holds_blocks_or_progress_is_a_bug():
    """An admission starts from nothing: a sequence that kept blocks or computed tokens
    (a preemption that forgot to free them) would leak or double-count them."""
    manager = KVCacheManager(num_blocks=4, block_size=4)
    holds_blocks = make_seq(range(8), "blocks")
    assert manager.allocate_slots(holds_blocks, 4)
    with pytest.raises(AssertionError):
        manager.allocate_slots(holds_blocks, 4, [])
    has_progress = make_seq(range(8), "progress")
    has_progress.num_computed_tokens = 4
    with pytest.raises(AssertionError):
        manager.allocate_slots(has_progress, 4, [])


def test_a_growing_sequence_is_refused_when_the_pool_is_empty():
    manager = KVCacheManager(num_blocks=2, block_size=2)
    seq = make_seq([1, 2, 3, 4])
    compute(manager, seq, 4)
    seq.token_ids.append(5)
    assert not manager.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 0


def test_full_blocks_carry_the_hash_chained_from_their_prefix():
    """Block i's hash is hash(block i-1's hash, block i's tokens), also when block i
    fills in a later step than block i-1 (a later prefill chunk, or a decode)."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3, 4, 5])
    compute(manager, seq, 3, computed_blocks=[])  # block 0 full, block 1 half
    compute(manager, seq, 2)  # block 1 full (a second chunk), block 2 half
    seq.token_ids.append(6)
    compute(manager, seq, 1)  # block 2 full (a decode)
    h0 = hash_block_tokens(b"", [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    h2 = hash_block_tokens(h1, [5, 6])
    hashes = manager.allocator.block_hashes
    assert [hashes[b] for b in seq.block_table] == [h0, h1, h2]
    assert manager.allocator.cached_block_ids == dict(zip([h0, h1, h2], seq.block_table))


def test_equal_blocks_after_different_prefixes_are_not_shared():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], "a")
    compute(manager, a, 5, computed_blocks=[])
    b = make_seq([9, 9, 3, 4, 5], "b")  # the same second block, after another first one
    assert manager.get_computed_blocks(b) == []
    compute(manager, b, 5, computed_blocks=[])
    hashes = manager.allocator.block_hashes
    assert hashes[a.block_table[1]] != hashes[b.block_table[1]]
    assert manager.allocator.num_cached_blocks == 4


def test_a_lookup_stops_at_the_first_missing_block():
    """If a middle block was evicted, the blocks after it are useless (their keys and
    values were computed after the evicted ones): the hit ends before the gap."""
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3, 4, 5, 6, 7], "old")
    compute(manager, old, 7, computed_blocks=[])
    first, middle, last, _partial = old.block_table
    manager.free(old)
    allocator = manager.allocator
    allocator.touch(_partial)
    allocator.touch(last)  # keep the last full block; the next allocation evicts the middle
    assert allocator.allocate() == middle
    probe = make_seq([1, 2, 3, 4, 5, 6, 0], "probe")
    assert allocator.get_cached_block(allocator.block_hashes[last]) == last
    assert manager.get_computed_blocks(probe) == [first]


@pytest.mark.parametrize("prompt_len, hit_blocks", [(4, 1), (5, 2), (6, 2), (7, 3), (8, 3)])
def test_the_hit_is_capped_below_the_last_token(prompt_len, hit_blocks):
    """At most len - 1 tokens, in whole blocks: the last token is always computed."""
    manager = KVCacheManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    compute(manager, make_seq(range(10), "a"), 10, computed_blocks=[])
    hit = manager.get_computed_blocks(make_seq(range(prompt_len), "b"))
    assert len(hit) == hit_blocks


def test_hit_statistics_count_admissions_only():
    manager = KVCacheManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5], "a")
    compute(manager, a, 5, computed_blocks=[])
    a.token_ids.append(6)
    compute(manager, a, 1)  # a decode is not a lookup
    stats = manager.prefix_cache_stats
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (5, 0)
    assert stats.hit_rate == 0.0
    b = make_seq([1, 2, 3, 4, 5, 6, 7], "b")
    hit = manager.get_computed_blocks(b)
    compute(manager, b, 1, computed_blocks=hit)
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (12, 6)
    assert stats.hit_rate == 0.5
    assert manager.prefix_cache_stats.hit_rate == pytest.approx(6 / 12)


def test_reset_prefix_cache_waits_for_idle_and_zeroes_the_counters():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3], "a")
    compute(manager, a, 3, computed_blocks=[])
    assert manager.reset_prefix_cache() is False
    assert manager.prefix_cache_stats.num_queried_tokens == 3
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.prefix_cache_stats.num_queried_tokens == 0
    assert manager.allocator.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_seq([1, 2, 3], "b")) == []


def test_freeing_returns_the_tail_first_so_the_prefix_is_evicted_last():
    manager = KVCacheManager(num_blocks=3, block_size=1, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3])
    compute(manager, seq, 3, computed_blocks=[])
    table = list(seq.block_table)
    manager.free(seq)
    assert list(manager.allocator.free_block_ids) == table[::-1]


def test_a_request_asking_for_prompt_logprobs_gets_no_cache_hit():
    # Its prompt logprobs need every prompt row computed (vLLM skips the cache too).
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = Sequence("a", list(range(9)), SamplingParams())
    assert manager.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    manager.cache_full_blocks(first)
    again = Sequence("b", list(range(9)), SamplingParams())
    assert len(manager.get_computed_blocks(again)) == 2
    asks = Sequence("c", list(range(9)), SamplingParams(prompt_logprobs=1))
    assert manager.get_computed_blocks(asks) == []
