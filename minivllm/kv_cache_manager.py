"""Per-request block tables: which blocks of the pool hold which request's tokens.

Like a page table: token ``pos`` of a request lives in block ``block_table[pos // block_size]``
at offset ``pos % block_size``. The manager grows a table block by block as the request's
computed tokens grow, and gives every block back when the request finishes or is preempted.
"""

from __future__ import annotations

from minivllm.block_allocator import BlockAllocator
from minivllm.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens of ``seq``.

        Returns False, allocating nothing, when the pool has too few free blocks."""
        total = seq.num_computed_tokens + num_new_tokens
        num_missing = self.num_blocks_needed(total) - len(seq.block_table)
        if num_missing > self.allocator.num_free_blocks:
            return False
        for _ in range(num_missing):
            seq.block_table.append(self.allocator.allocate())
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool (newest first, so that the oldest
        are reused last)."""
        for block_id in reversed(seq.block_table):
            self.allocator.free(block_id)
        seq.block_table = []
