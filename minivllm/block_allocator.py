"""The page allocator: a fixed pool of KV-cache blocks, handed out and taken back in O(1).

A block is ``block_size`` token slots in every layer's cache tensor. The allocator only
deals in block *ids*; it never touches the cache memory, so a request joining or leaving
costs no copy. Reference counts let several block tables share one block (prefix caching).

With prefix caching, a full block can also carry a *hash* naming its contents (see
`kv_cache_manager.hash_block_tokens`). A cached block whose last owner finished stays in
the free queue with its contents intact: a later request with the same prefix can take it
back (`touch`) instead of recomputing it, until `allocate` needs the space and evicts it.
The free queue is ordered: blocks are appended when freed and taken from the front, so
the least recently freed cached block is the one evicted (LRU), all in O(1).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockAllocator:
    """Free queue + reference counts (+ the hash -> block map) over ids ``0 .. num_blocks - 1``.

    Every block is in exactly one of two states: *free* (reference count 0, in the free
    queue, possibly still cached) or *used* (reference count = number of block tables that
    hold it). ``num_free_blocks + num_used_blocks == num_blocks`` always.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # An OrderedDict used as a queue that can also drop any member in O(1): the front
        # is the next block `allocate` hands out (and evicts, if it is cached).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # None: not a full block
        self.cached_block_ids: dict[bytes, int] = {}  # hash -> the block that holds it

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out, cached ones (evictable) included."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_ids)

    def allocate(self) -> int:
        """Take the least recently freed block; its reference count becomes 1. If it still
        caches a prefix, that entry is evicted: the block is about to be overwritten."""
        if not self.free_block_ids:
            raise RuntimeError("no free KV-cache blocks (the caller must check first)")
        block_id, _ = self.free_block_ids.popitem(last=False)
        assert self.ref_counts[block_id] == 0, f"free block {block_id} is still referenced"
        self._evict(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference; when nobody holds the block it joins the back of the free
        queue, keeping its cached contents until it reaches the front."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} freed more often than taken"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None

    def touch(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit). A free one leaves
        the free queue, so it can no longer be evicted."""
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the contents named ``block_hash``, if one is cached."""
        return self.cached_block_ids.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Record that used block ``block_id`` is full and holds the contents ``block_hash``.

        If another block already caches the same contents (two requests computed the same
        prefix in the same step), the map keeps the first one; this block still knows its
        hash, so requests that own it can keep chaining hashes from it."""
        assert self.ref_counts[block_id] > 0, f"caching free block {block_id}"
        assert self.block_hashes[block_id] in (None, block_hash), f"block {block_id} changed"
        self.block_hashes[block_id] = block_hash
        self.cached_block_ids.setdefault(block_hash, block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. between benchmark runs). Only when no block is in
        use, as in vLLM: a used block's hash is still needed to chain its owner's next one."""
        if self.num_used_blocks:
            return False
        for block_id in self.free_block_ids:
            self._evict(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        self.block_hashes[block_id] = None
        if self.cached_block_ids.get(block_hash) == block_id:
            del self.cached_block_ids[block_hash]
