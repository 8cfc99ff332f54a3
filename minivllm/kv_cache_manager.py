"""Per-request block tables: which blocks of the pool hold which request's tokens.

Like a page table: token ``pos`` of a request lives in block ``block_table[pos // block_size]``
at offset ``pos % block_size``. The manager grows a table block by block as the request's
computed tokens grow, and gives every block back when the request finishes or is preempted.
The manager is the only writer of ``seq.block_table``, and it changes the list in place
(extend, truncate, clear); a step's record keeps its own copy (scheduler_output.py).

Automatic prefix caching (vLLM's design). Each *full* block of a request is named by a
chained hash: ``hash(parent block's hash, this block's token ids)``, so equal hashes mean
equal tokens at equal positions *and* an equal prefix before them, hence equal keys and
values. `cache_full_blocks` registers the blocks that become full (prefill chunks and
decodes alike; never one holding a draft token not verified yet).
When a request is admitted, `get_computed_blocks` looks up its block hashes in order and
returns the longest cached run; the request shares those blocks (reference count + 1) and
starts computing after them.

A block is registered as soon as a step that computes it is *scheduled*, as in vLLM: every
layer writes the whole step's keys and values before any attention reads them, so a
request admitted later in the same step can already share it. That is what lets the ``n``
children of one prompt (parallel_sampling.py) compute the prompt once although they are
all admitted together. Children are marked ``shares_prompt``: they hash and look up blocks
even when prefix caching is off (then nobody else does).

A prefix hit only ever shares full blocks, and a full block is never written again (a
request only writes at positions ``>= num_computed_tokens``, past its shared blocks). The
hit is capped below the request's last token: the model has to run on at least one token
to produce the logits for the next one (nano-vllm #114 crashed on a 100 % hit), and the
cap is whole blocks so that the recomputed tail goes to fresh blocks.

Fork and copy-on-write (PagedAttention, Kwon et al. SOSP 2023, section 4.4; beam search,
beam_search.py). `fork` gives a new sequence its parent's whole table, the last, *partial*
block included: every block gains one reference, nothing is copied. The first of the two
to write its next token into that shared partial block gets a fresh block instead:
`allocate_slots` takes one, drops a reference to the shared one and records the copy
``(src, dst)``. The scheduler hands the step's copies to the model runner, which copies
those blocks in every layer's K and V cache before the forward runs. Only a last, partial
block can ever need this: full blocks are never written. With ``share_forked_blocks=False``
a fork copies every block at once instead, as a cache without shared paging must (kept to
measure what sharing saves).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass

from minivllm.block_allocator import BlockAllocator
from minivllm.sequence import Sequence
from minivllm.utils import cdiv


def hash_block_tokens(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """The name of a full block: SHA-256 of the parent block's hash and this block's tokens.

    A strong hash instead of Python's ``hash()``: a collision would silently hand a request
    someone else's keys and values, and ``hash()`` of a tuple is 64 bits and not
    collision-resistant (``hash(-1) == hash(-2)`` in CPython). With 256 bits a collision is
    not a practical concern, so matching hashes need no token-by-token check."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the engine started, counted in tokens (like vLLM's)."""

    num_queried_tokens: int = 0  # tokens of the requests looked up at admission
    num_hit_tokens: int = 0  # of those, tokens found in the cache (prefill saved)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        share_forked_blocks: bool = True,
    ):
        """``share_forked_blocks``: a `fork` shares the parent's blocks (copy-on-write);
        False copies them all at once, each fork holding its own (for comparison)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_forked_blocks = share_forked_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self._table_ids = itertools.count(1)  # `Sequence.block_table_id`: 0 means none yet
        # Copies decided since the scheduler last took them: (src, dst) block ids, done by
        # the model runner before the step's forward.
        self.blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached blocks that starts ``seq``'s tokens, for a request
        about to be admitted; it holds ``len(result) * block_size`` tokens. Nothing is
        taken yet: `allocate_slots` does that, if the rest of the request fits."""
        if not self._caches(seq) or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt row computed (vLLM skips too)
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size  # always compute the last
        blocks: list[int] = []
        parent_hash = b""
        for i in range(max_hit_blocks):
            parent_hash = hash_block_tokens(parent_hash, self._block_tokens(seq, i))
            block_id = self.allocator.get_cached_block(parent_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens of ``seq``.

        ``computed_blocks`` is given when ``seq`` is being admitted (it holds no blocks):
        its prefix-cache hit from `get_computed_blocks`, maybe empty, shared before the new
        blocks. Returns False, taking nothing, when the pool has too few free blocks; cached
        blocks that sit in the free queue count against it, as sharing takes them out."""
        is_admission = computed_blocks is not None
        num_to_copy = 0 if is_admission else self._num_blocks_to_copy(seq)
        if (
            not num_to_copy
            and not is_admission
            and (seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size)
        ):
            return True  # most decode steps: the last block still has room
        computed_blocks = computed_blocks or []
        assert not is_admission or (seq.num_computed_tokens == 0 and not seq.block_table)
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_missing = (
            self.num_blocks_needed(num_computed + num_new_tokens)
            - len(seq.block_table)
            - len(computed_blocks)
        )
        num_hit_free = sum(self.allocator.ref_counts[b] == 0 for b in computed_blocks)
        if num_missing + num_to_copy + num_hit_free > self.allocator.num_free_blocks:
            return False
        if num_to_copy:
            self._copy_on_write(seq)
        for block_id in computed_blocks:
            self.allocator.touch(block_id)
        if not seq.block_table:  # a table starts: a new request, or one back from preemption
            seq.block_table_id = next(self._table_ids)
        seq.block_table.extend(computed_blocks)
        seq.block_table.extend(self.allocator.allocate() for _ in range(num_missing))
        if is_admission and self.enable_prefix_caching:
            self.prefix_cache_stats.num_queried_tokens += seq.num_tokens
            self.prefix_cache_stats.num_hit_tokens += len(computed_blocks) * self.block_size
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` (holding no blocks) ``parent``'s computed tokens: the same blocks,
        each one reference more, and the same ``num_computed_tokens``. The child's tokens
        must start with the parent's computed ones. With ``share_forked_blocks=False`` the
        child gets copies of every block instead; False, taking nothing, when the pool has
        too few free blocks for them."""
        assert not child.block_table and parent.block_table
        assert (
            child.token_ids[: parent.num_computed_tokens]
            == parent.token_ids[: parent.num_computed_tokens]
        )
        if self.share_forked_blocks:
            for block_id in parent.block_table:
                self.allocator.touch(block_id)
            child.block_table.extend(parent.block_table)
        else:
            if len(parent.block_table) > self.allocator.num_free_blocks:
                return False
            for src in parent.block_table:
                dst = self.allocator.allocate()
                if self.allocator.block_hashes[src] is not None:  # a full block: same contents
                    self.allocator.cache_block(dst, self.allocator.block_hashes[src])
                self.blocks_to_copy.append((src, dst))
                child.block_table.append(dst)
        child.block_table_id = next(self._table_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        return True

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copies decided since the last call, for the step being scheduled; then none.

        A block freed and handed out again in the same step may be the target of two
        copies: only the last counts (the model runner gathers every source before it
        writes any target, so a source freed and reused as a target is read first)."""
        if not self.blocks_to_copy:
            return []
        last_src_of = {dst: src for src, dst in self.blocks_to_copy}
        self.blocks_to_copy = []
        return [(src, dst) for dst, src in last_src_of.items()]

    def _num_blocks_to_copy(self, seq: Sequence) -> int:
        """1 if ``seq``'s next token goes into a block it shares (a fork's partial last
        block), else 0."""
        if not seq.num_computed_tokens % self.block_size:
            return 0  # the next token starts a new block
        return int(self.allocator.ref_counts[seq.block_table[-1]] > 1)

    def _copy_on_write(self, seq: Sequence) -> None:
        """Replace ``seq``'s shared last block by a fresh copy of it, which it alone
        writes; the other holders keep the original."""
        src = seq.block_table[-1]
        assert len(seq.block_table) == self.num_blocks_needed(seq.num_computed_tokens)
        assert self.allocator.block_hashes[src] is None, "a full block is never written"
        dst = self.allocator.allocate()
        self.allocator.free(src)  # one reference of several: src stays in use
        seq.block_table[-1] = dst
        seq.block_table_id = next(self._table_ids)  # not only grown: a new table
        self.blocks_to_copy.append((src, dst))

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register ``seq``'s blocks that are full of computed *and known* tokens and not
        registered yet, so that later requests can share them. ``num_computed_tokens``:
        what the step being scheduled will have computed (default: what is computed now).

        "Known" matters with speculative decoding: accepted drafts are computed in the step
        that verifies them but join ``seq.token_ids`` only afterwards (the output processor
        appends them), so their block is registered one step later. Rejected drafts lie
        past ``num_computed_tokens`` and are never registered: no block holding an
        unverified token can be shared."""
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        end = min(num_computed_tokens, seq.num_tokens) // self.block_size
        block_hashes = self.allocator.block_hashes
        if end == 0 or block_hashes[seq.block_table[end - 1]] is not None:
            return  # most steps: no block filled since the last call (checked first: cheap)
        if not self._caches(seq):
            return
        first = end  # blocks are registered in order: walk back to the first unregistered
        while first > 0 and block_hashes[seq.block_table[first - 1]] is None:
            first -= 1
        for i in range(first, end):
            parent_hash = b"" if i == 0 else block_hashes[seq.block_table[i - 1]]
            block_hash = hash_block_tokens(parent_hash, self._block_tokens(seq, i))
            self.allocator.cache_block(seq.block_table[i], block_hash)

    def free_surplus_blocks(self, seq: Sequence) -> None:
        """Give back the blocks past ``ceil(num_computed_tokens / block_size)``: after
        rejected drafts they hold nothing that will be read (speculative decoding)."""
        num_needed = self.num_blocks_needed(seq.num_computed_tokens)
        if num_needed == len(seq.block_table):
            return
        for block_id in reversed(seq.block_table[num_needed:]):
            assert self.allocator.block_hashes[block_id] is None, "a draft block was cached"
            self.allocator.free(block_id)
        del seq.block_table[num_needed:]
        seq.block_table_id = next(self._table_ids)  # not only grown: a new table

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool, newest first: the free queue is LRU,
        so a request's tail blocks are evicted before the prefix others are likelier to
        share."""
        for block_id in reversed(seq.block_table):
            self.allocator.free(block_id)
        seq.block_table.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes and zero the hit counters; False (and nothing done)
        while any request holds blocks."""
        if not self.allocator.reset_prefix_cache():
            return False
        self.prefix_cache_stats = PrefixCacheStats()
        return True

    def _caches(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching or seq.shares_prompt

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
