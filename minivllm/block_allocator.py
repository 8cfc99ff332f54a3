"""The page allocator: a fixed pool of KV-cache blocks, handed out and taken back in O(1).

A block is ``block_size`` token slots in every layer's cache tensor. The allocator only
deals in block *ids*; it never touches the cache memory, so a request joining or leaving
costs no copy. Reference counts let several block tables share one block (prefix caching).
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Free list + reference counts over block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        if not self.free_block_ids:
            raise RuntimeError("no free KV-cache blocks (the caller must check first)")
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0, f"free block {block_id} is still referenced"
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference; the block is free again when nobody holds it."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)
