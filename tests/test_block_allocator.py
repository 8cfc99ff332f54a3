"""The page allocator on its own: free queue, reference counts, LRU eviction of cached blocks."""

import pytest

from minivllm.block_allocator import BlockAllocator


def test_allocate_all_then_free_all():
    allocator = BlockAllocator(4)
    blocks = [allocator.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert allocator.num_free_blocks == 0 and allocator.num_used_blocks == 4
    with pytest.raises(
        RuntimeError, match=r"^no free KV-cache blocks \(the caller must check first\)$"
    ):
        allocator.allocate()
    for block_id in blocks:
        allocator.free(block_id)
    assert allocator.num_free_blocks == 4 and allocator.ref_counts == [0] * 4


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="at least 1"):
        BlockAllocator(0)


def test_shared_block_is_free_only_after_its_last_owner_frees_it():
    allocator = BlockAllocator(2)
    block_id = allocator.allocate()
    allocator.touch(block_id)  # a second block table shares it
    assert allocator.ref_counts[block_id] == 2
    allocator.free(block_id)
    assert allocator.num_free_blocks == 1  # still held once
    allocator.free(block_id)
    assert allocator.num_free_blocks == 2


def test_freeing_more_often_than_taken_is_caught():
    allocator = BlockAllocator(1)
    block_id = allocator.allocate()
    allocator.free(block_id)
    with pytest.raises(AssertionError, match="freed more often"):
        allocator.free(block_id)


def test_freed_blocks_are_reused_least_recently_freed_first():
    allocator = BlockAllocator(3)
    a, b, c = (allocator.allocate() for _ in range(3))
    for block_id in (b, c, a):
        allocator.free(block_id)
    assert [allocator.allocate() for _ in range(3)] == [b, c, a]


def test_cached_block_survives_its_owner_until_the_space_is_needed():
    allocator = BlockAllocator(2)
    block_id = allocator.allocate()
    allocator.cache_block(block_id, b"h")
    allocator.free(block_id)
    assert allocator.num_free_blocks == 2  # cached but evictable: counts as free
    assert allocator.get_cached_block(b"h") == block_id

    allocator.touch(block_id)  # a hit takes it out of the free queue
    assert allocator.ref_counts[block_id] == 1 and allocator.num_free_blocks == 1
    assert allocator.allocate() != block_id  # so it cannot be handed out or evicted
    assert allocator.get_cached_block(b"h") == block_id


def test_allocate_evicts_the_least_recently_freed_cached_block():
    allocator = BlockAllocator(3)
    blocks = [allocator.allocate() for _ in range(3)]
    for i, block_id in enumerate(blocks):
        allocator.cache_block(block_id, bytes([i]))
    for block_id in blocks:  # freed in order 0, 1, 2
        allocator.free(block_id)
    evicted = allocator.allocate()
    assert evicted == blocks[0]
    assert allocator.get_cached_block(bytes([0])) is None
    assert allocator.block_hashes[evicted] is None  # about to be overwritten
    assert allocator.get_cached_block(bytes([1])) == blocks[1]
    assert allocator.get_cached_block(bytes([2])) == blocks[2]
    assert allocator.num_cached_blocks == 2


def test_duplicate_contents_keep_the_first_block_in_the_map():
    allocator = BlockAllocator(2)
    first, second = allocator.allocate(), allocator.allocate()
    allocator.cache_block(first, b"same")
    allocator.cache_block(second, b"same")  # e.g. identical prompts in one step
    assert allocator.get_cached_block(b"same") == first
    assert allocator.block_hashes[second] == b"same"  # still known, for chaining
    # Evicting the duplicate must not drop the entry of the block that is in the map.
    allocator.free(second)
    assert allocator.allocate() == second
    assert allocator.get_cached_block(b"same") == first


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_used():
    allocator = BlockAllocator(2)
    block_id = allocator.allocate()
    allocator.cache_block(block_id, b"h")
    assert allocator.reset_prefix_cache() is False  # still owned
    assert allocator.get_cached_block(b"h") == block_id
    allocator.free(block_id)
    assert allocator.reset_prefix_cache() is True
    assert allocator.get_cached_block(b"h") is None and allocator.block_hashes == [None, None]
    assert allocator.num_free_blocks == 2


def test_only_a_used_block_can_be_cached():
    """Caching is recorded by a block's owner right after computing it; a free block may
    be handed out and overwritten at any moment, so naming its contents is a bug."""
    allocator = BlockAllocator(2)
    with pytest.raises(AssertionError, match="caching free block 0"):
        allocator.cache_block(0, b"h")
    block_id = allocator.allocate()
    allocator.cache_block(block_id, b"h")
    with pytest.raises(AssertionError, match="changed"):
        allocator.cache_block(block_id, b"other")  # a full block is never rewritten


def test_touching_a_used_block_keeps_the_free_queue():
    allocator = BlockAllocator(3)
    block_id = allocator.allocate()
    allocator.touch(block_id)
    assert allocator.num_free_blocks == 2 and allocator.ref_counts[block_id] == 2
    assert allocator.num_used_blocks == 1 and allocator.num_blocks == 3
