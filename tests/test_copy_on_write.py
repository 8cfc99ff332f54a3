"""Fork and copy-on-write in the block layer (PagedAttention, section 4.4).

A fork shares every block of its parent, reference counts + 1; the first write into a
shared partial block gets a fresh block and a recorded copy ``(src, dst)``; the model
runner copies those blocks' keys and values in every layer before the step's forward.
The property test plays forks, decodes and frees against a cache whose "keys" are the
token ids themselves, with the runner's real `copy_blocks`, and reads every sequence's
tokens back through its block table.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.model_runner import ModelRunner
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, list(token_ids), SamplingParams())


def compute(manager, seq, num_tokens):
    """One scheduler step + model step for ``seq``: room for its next tokens, then they
    count as computed (and their full blocks are registered, if it caches)."""
    assert manager.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.cache_full_blocks(seq)


def forked(manager, parent, request_id, next_token):
    """A child holding the parent's computed tokens plus its own next token."""
    child = make_seq(parent.token_ids[: parent.num_computed_tokens] + [next_token], request_id)
    assert manager.fork(parent, child)
    return child


def ref_counts_match_tables(manager, seqs):
    """Each block's reference count is the number of tables holding it."""
    expected = [0] * manager.num_blocks
    for seq in seqs:
        for block_id in seq.block_table:
            expected[block_id] += 1
    return manager.allocator.ref_counts == expected


def test_a_fork_shares_every_block_and_the_computed_tokens():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_seq(range(10), "p")
    compute(manager, parent, 10)  # 2 full blocks + 2 tokens in a third
    child = forked(manager, parent, "c", 99)
    assert child.block_table == parent.block_table and len(child.block_table) == 3
    assert child.num_computed_tokens == 10
    assert child.block_table_id not in (0, parent.block_table_id)
    assert [manager.allocator.ref_counts[b] for b in parent.block_table] == [2, 2, 2]
    assert manager.num_free_blocks == 5  # nothing taken
    assert manager.take_blocks_to_copy() == []


def test_the_first_write_into_a_shared_partial_block_copies_it():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_seq(range(10), "p")
    compute(manager, parent, 10)
    parent.token_ids.append(50)
    child = forked(manager, parent, "c", 51)
    shared = parent.block_table[-1]
    table_id = child.block_table_id

    assert manager.allocate_slots(child, 1)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[-1] not in parent.block_table
    assert manager.take_blocks_to_copy() == [(shared, child.block_table[-1])]
    assert manager.allocator.ref_counts[shared] == 1  # the parent's alone now
    assert child.block_table_id != table_id  # the runner must rewrite the row
    # The parent writes in place: nobody else holds its block any more.
    assert manager.allocate_slots(parent, 1)
    assert parent.block_table[-1] == shared and manager.take_blocks_to_copy() == []
    assert ref_counts_match_tables(manager, [parent, child])


def test_no_copy_when_the_shared_last_block_is_full():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_seq(range(8), "p")
    compute(manager, parent, 8)  # exactly two full blocks
    parent.token_ids.append(50)
    child = forked(manager, parent, "c", 51)
    for seq in (child, parent):
        assert manager.allocate_slots(seq, 1)
    assert manager.take_blocks_to_copy() == []
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]  # each its own new block
    assert ref_counts_match_tables(manager, [parent, child])


def test_copy_on_write_is_refused_taking_nothing_when_the_pool_is_empty():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_seq(range(6), "p")
    compute(manager, parent, 6)  # both blocks
    child = forked(manager, parent, "c", 7)
    table = list(child.block_table)
    assert not manager.allocate_slots(child, 1)
    assert child.block_table == table and manager.take_blocks_to_copy() == []
    assert manager.allocator.ref_counts == [2, 2]


def test_freeing_forks_in_any_order_frees_every_block():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_seq(range(6), "p")
    compute(manager, parent, 6)
    children = [forked(manager, parent, f"c{i}", 100 + i) for i in range(3)]
    assert manager.allocator.ref_counts[parent.block_table[0]] == 4
    compute(manager, children[1], 1)  # one copy-on-write
    manager.free(parent)
    assert ref_counts_match_tables(manager, children)
    for child in children:
        manager.free(child)
    assert manager.num_free_blocks == 8 and manager.allocator.ref_counts == [0] * 8


def test_full_blocks_keep_their_hash_and_a_copied_block_has_none():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = make_seq(range(6), "p")
    compute(manager, parent, 6)
    full, partial = parent.block_table
    full_hash = manager.allocator.block_hashes[full]
    assert full_hash is not None and manager.allocator.block_hashes[partial] is None
    parent.token_ids.append(60)
    child = forked(manager, parent, "c", 61)
    compute(manager, child, 1)
    copy = child.block_table[-1]
    assert manager.allocator.block_hashes[full] == full_hash
    assert manager.allocator.block_hashes[copy] is None
    # Filling the two partial blocks differently registers two different contents.
    for seq, token in ((parent, 60), (child, 62)):
        if seq is parent:
            compute(manager, seq, 1)
        seq.token_ids.append(token)
        compute(manager, seq, 1)
    assert manager.allocator.block_hashes[partial] is not None
    assert manager.allocator.block_hashes[copy] is not None
    assert manager.allocator.block_hashes[partial] != manager.allocator.block_hashes[copy]


def test_without_sharing_a_fork_copies_every_block_at_once():
    manager = KVCacheManager(num_blocks=8, block_size=4, share_forked_blocks=False)
    parent = make_seq(range(10), "p")
    compute(manager, parent, 10)
    child = forked(manager, parent, "c", 99)
    assert set(child.block_table).isdisjoint(parent.block_table)
    assert manager.take_blocks_to_copy() == list(zip(parent.block_table, child.block_table))
    assert manager.num_free_blocks == 2
    assert ref_counts_match_tables(manager, [parent, child])
    compute(manager, child, 1)
    assert manager.take_blocks_to_copy() == []  # its own partial block: no copy-on-write
    tight = KVCacheManager(num_blocks=4, block_size=4, share_forked_blocks=False)
    big = make_seq(range(10), "big")
    compute(tight, big, 10)
    assert not tight.fork(big, make_seq(range(10), "no room"))
    assert tight.allocator.ref_counts == [1, 1, 1, 0]


def test_a_target_reused_within_a_step_keeps_only_its_last_copy():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    manager.blocks_to_copy = [(0, 2), (1, 3), (1, 2)]
    assert manager.take_blocks_to_copy() == [(1, 2), (1, 3)]
    assert manager.take_blocks_to_copy() == []


def make_copy_runner(num_blocks, block_size, num_layers=2):
    """A runner with only a KV cache: [layer][k/v][block][slot][kv_head][dim]."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv_caches = torch.zeros(num_layers, 2, num_blocks, block_size, 1, 2)
    return runner


def test_the_runner_copies_keys_and_values_in_every_layer():
    runner = make_copy_runner(num_blocks=4, block_size=2, num_layers=3)
    runner.kv_caches.normal_()
    before = runner.kv_caches.clone()
    runner.copy_blocks([(1, 3), (3, 0)])  # block 3 is read before it is written
    assert torch.equal(runner.kv_caches[:, :, 3], before[:, :, 1])
    assert torch.equal(runner.kv_caches[:, :, 0], before[:, :, 3])
    assert torch.equal(runner.kv_caches[:, :, 1:3], before[:, :, 1:3])


OPS = st.lists(
    st.tuples(st.sampled_from(["fork", "decode", "free"]), st.integers(0, 99)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=OPS,
    block_size=st.sampled_from([1, 2, 3, 4]),
    prompt_len=st.integers(1, 9),
    share=st.booleans(),
    caching=st.booleans(),
)
def test_forks_decodes_and_frees_keep_every_sequence_reading_its_own_tokens(
    ops, block_size, prompt_len, share, caching
):
    """Played step by step: copies run before the step's writes, as in the runner. The
    cache's "key" at a slot is the token id written there; every live sequence must read
    its computed tokens back through its table, and reference counts match the tables."""
    num_blocks = 24
    manager = KVCacheManager(num_blocks, block_size, caching, share_forked_blocks=share)
    runner = make_copy_runner(num_blocks, block_size)
    keys = runner.kv_caches[0, 0, :, :, 0, 0]  # [block, slot] view of layer 0's keys
    root = make_seq(range(1, prompt_len + 1), "0")
    seqs = [root]

    def step(seq, num_new):
        """Schedule ``num_new`` tokens of ``seq``, run the copies, write, advance."""
        if not manager.allocate_slots(seq, num_new):
            return False
        runner.copy_blocks(manager.take_blocks_to_copy())
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = seq.block_table[pos // block_size]
            keys[block, pos % block_size] = seq.token_ids[pos]
        seq.num_computed_tokens += num_new
        manager.cache_full_blocks(seq)
        return True

    assert step(root, prompt_len)
    next_id = 1
    for op, pick in ops:
        if not seqs:
            break
        seq = seqs[pick % len(seqs)]
        if op == "fork" and seq.num_computed_tokens == seq.num_tokens:
            child = make_seq(seq.token_ids + [1000 + next_id], str(next_id))
            next_id += 1
            if manager.fork(seq, child):
                runner.copy_blocks(manager.take_blocks_to_copy())
                seqs.append(child)
        elif op == "decode":
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(2000 + pick)
            step(seq, 1)
        elif op == "free":
            manager.free(seq)
            seqs.remove(seq)
        assert ref_counts_match_tables(manager, seqs)
        for s in seqs:
            assert len(s.block_table) == manager.num_blocks_needed(s.num_computed_tokens)
            read = [
                int(keys[s.block_table[p // block_size], p % block_size])
                for p in range(s.num_computed_tokens)
            ]
            assert read == s.token_ids[: s.num_computed_tokens]
    for seq in seqs:
        manager.free(seq)
    assert manager.num_free_blocks == num_blocks
    assert manager.allocator.ref_counts == [0] * num_blocks


@pytest.mark.parametrize("share", [True, False])
def test_a_fork_needs_a_parent_with_blocks_and_a_child_without(share):
    manager = KVCacheManager(num_blocks=8, block_size=4, share_forked_blocks=share)
    parent = make_seq(range(4), "p")
    with pytest.raises(AssertionError):
        manager.fork(parent, make_seq(range(4), "c"))  # the parent holds nothing yet
    compute(manager, parent, 4)
    child = forked(manager, parent, "c", 9)
    with pytest.raises(AssertionError):
        manager.fork(parent, child)  # already holds blocks


def test_without_sharing_copies_of_full_blocks_keep_their_hash_and_a_tight_pool_is_enough():
    # The pool has exactly the parent's 3 blocks free: the fork fits. The copies of the
    # full blocks hold the same tokens, so they are registered under the same hashes (a
    # later request can share them); the partial block's copy has none.
    manager = KVCacheManager(
        num_blocks=6, block_size=4, enable_prefix_caching=True, share_forked_blocks=False
    )
    parent = make_seq(range(10), "p")
    compute(manager, parent, 10)
    assert manager.num_free_blocks == 3
    child = forked(manager, parent, "c", 99)
    hashes = manager.allocator.block_hashes
    assert [hashes[b] for b in child.block_table[:2]] == [hashes[b] for b in parent.block_table[:2]]
    assert hashes[parent.block_table[0]] is not None and hashes[child.block_table[2]] is None
    assert manager.num_free_blocks == 0


def test_every_new_table_gets_an_id_no_table_had_before():
    # The contract the runner's persistent batch and `block_table_snapshot` rely on: a
    # table that is not only grown (a fork's, a copy-on-write's, one cut short) gets a
    # fresh id, a positive int.
    manager = KVCacheManager(num_blocks=12, block_size=4)
    parent = make_seq(range(6), "p")
    compute(manager, parent, 6)
    seen = [parent.block_table_id]
    child = forked(manager, parent, "c", 7)
    seen.append(child.block_table_id)
    parent.token_ids.append(8)
    compute(manager, parent, 1)  # copy-on-write of the shared partial block
    seen.append(parent.block_table_id)
    copier = KVCacheManager(num_blocks=12, block_size=4, share_forked_blocks=False)
    copier._table_ids = manager._table_ids  # one id sequence: ids compared across both
    other = make_seq(range(6), "o")
    compute(copier, other, 6)
    seen.append(other.block_table_id)
    seen.append(forked(copier, other, "oc", 9).block_table_id)
    other.token_ids.extend([1, 2, 3])
    assert copier.allocate_slots(other, 3)
    seen.append(other.block_table_id)  # grown: the same table
    other.num_computed_tokens = 6
    copier.free_surplus_blocks(other)  # cut short: a new one
    seen.append(other.block_table_id)
    assert all(isinstance(i, int) and i > 0 for i in seen)
    assert seen[:5] == sorted(set(seen[:5])) and seen[5] == seen[3] and seen[6] > seen[4]
    assert child.block_table_snapshot() == tuple(child.block_table)
