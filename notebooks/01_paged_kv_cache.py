# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. The paged KV cache, by hand
#
# A transformer keeps the keys and values (K/V) of every token it has seen, so that the
# next token only needs one new row of attention. That store is the **KV cache**, and on a
# serving machine it is the memory that decides how many requests fit at once.
#
# minivllm, like vLLM, cuts the cache into fixed-size **blocks** of `block_size` token
# slots. A request owns a list of block ids, its **block table**, just as a process owns
# pages through a page table. In this notebook we drive the real classes by hand, with no
# model:
#
# - `BlockAllocator` (`minivllm/block_allocator.py`): a free list and reference counts;
# - `KVCacheManager` (`minivllm/kv_cache_manager.py`): grows and frees block tables;
# - `write_kv_cache` (`minivllm/attention/backend.py`): the one op that writes K/V into
#   the cache tensor, at the slots the block tables give.
#
# Instead of real key vectors we store each token's *id* in the cache, so the pictures can
# show which token sits in which slot.

# %%
import math
import random

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from minivllm.attention import write_kv_cache
from minivllm.kv_cache_manager import KVCacheManager
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

# %% [markdown]
# ## A small pool
#
# Twelve blocks of four slots each. The cache tensor has the same layout as one layer's
# key cache in `ModelRunner.kv_caches`: `[num_blocks, block_size, num_kv_heads, head_dim]`.
# Here `num_kv_heads = head_dim = 1` and an empty slot holds NaN.

# %%
NUM_BLOCKS, BLOCK_SIZE = 12, 4
manager = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
key_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, 1, 1), float("nan"))
value_cache = torch.full_like(key_cache, float("nan"))
print("free blocks:", list(manager.allocator.free_block_ids))


# %% [markdown]
# `compute(seq, n)` does, for one sequence, what one engine step does for every scheduled
# sequence: the scheduler makes room for `n` more tokens (`allocate_slots`), the model
# runner turns each token's position into a **slot** with the paged address
# `block_table[pos // block_size] * block_size + pos % block_size`, the attention layer
# writes the K/V there, and the scheduler advances `num_computed_tokens`.


# %%
def slot_mapping(seq: Sequence, start: int, num_new: int) -> torch.Tensor:
    """The flat cache slot of tokens ``start .. start + num_new - 1`` of ``seq``."""
    positions = range(start, start + num_new)
    return torch.tensor(
        [seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    )


def compute(seq: Sequence, num_new: int) -> None:
    assert manager.allocate_slots(seq, num_new), "pool is full"
    # Block copies the manager asked for (a fork's copy-on-write, at the end of this
    # notebook) happen before any new token is written, as the model runner does them.
    for src, dst in manager.take_blocks_to_copy():
        key_cache[dst], value_cache[dst] = key_cache[src], value_cache[src]
    start = seq.num_computed_tokens
    slots = slot_mapping(seq, start, num_new)
    tokens = torch.tensor(seq.token_ids[start : start + num_new], dtype=torch.float32)
    stand_in = tokens.view(-1, 1, 1)  # [num_tokens, num_kv_heads, head_dim]
    write_kv_cache(stand_in, stand_in, key_cache, value_cache, slots)
    seq.num_computed_tokens += num_new


def new_request(request_id: str, first_token: int, prompt_len: int) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(request_id, prompt, SamplingParams())


# %% [markdown]
# ## Drawing block tables and the pool
#
# The top panel shows each request's block table: logical block *j* of the request, and the
# physical block id it points to. The bottom panel is the cache tensor itself: every block
# with its four slots, coloured by the request that owns it, showing the token stored in
# each slot. Grey numbers are stale values in free blocks: nobody clears them, because
# nobody reads past a sequence's own context.

# %%
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"]


def draw(seqs: list[Sequence], title: str) -> None:
    owner = {}
    for i, seq in enumerate(seqs):
        for b in seq.block_table:
            owner.setdefault(b, []).append(i)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 1.2 + 0.55 * len(seqs) + 1.4), height_ratios=[len(seqs) + 0.5, 2.2]
    )
    fig.suptitle(title)

    top.set_xlim(-1.6, max(len(s.block_table) for s in seqs) + 0.2)
    top.set_ylim(-0.2, len(seqs))
    top.axis("off")
    for row, seq in enumerate(seqs):
        y = len(seqs) - 1 - row
        top.text(-0.2, y + 0.4, f"{seq.request_id}: {seq.num_computed_tokens} tokens", ha="right",
                 va="center", color=COLORS[row])  # fmt: skip
        for j, b in enumerate(seq.block_table):
            top.add_patch(Rectangle((j, y), 0.9, 0.8, fc=COLORS[row], alpha=0.35, ec="k"))
            top.text(j + 0.45, y + 0.4, f"→ {b}", ha="center", va="center")
    top.set_title("block tables (logical block → physical block id)", fontsize=10)

    bottom.set_xlim(0, NUM_BLOCKS * (BLOCK_SIZE + 1))
    bottom.set_ylim(-0.9, 1.3)
    bottom.axis("off")
    for b in range(NUM_BLOCKS):
        x0 = b * (BLOCK_SIZE + 1)
        holders = owner.get(b, [])
        color = COLORS[holders[0]] if holders else "white"
        for s in range(BLOCK_SIZE):
            bottom.add_patch(Rectangle((x0 + s, 0), 1, 1, fc=color, alpha=0.35, ec="k", lw=0.5))
            value = key_cache[b, s, 0, 0].item()
            if not math.isnan(value):
                bottom.text(x0 + s + 0.5, 0.5, int(value), ha="center", va="center", fontsize=7,
                            color="k" if holders else "0.6")  # fmt: skip
        label = f"{b}" + (f" (ref {len(holders)})" if len(holders) > 1 else "")
        bottom.text(x0 + BLOCK_SIZE / 2, -0.45, label, ha="center", fontsize=8)
    bottom.set_title("physical pool: key_cache[block, slot] (token id stand-ins)", fontsize=10)
    plt.tight_layout()
    plt.show()


# %% [markdown]
# ## Two requests arrive
#
# Request **A** has a 6-token prompt, request **B** a 9-token prompt. Computing a prompt
# ("prefill") takes `ceil(6 / 4) = 2` and `ceil(9 / 4) = 3` blocks.

# %%
seq_a = new_request("A", first_token=10, prompt_len=6)
seq_b = new_request("B", first_token=40, prompt_len=9)
compute(seq_a, seq_a.num_uncomputed_tokens)
compute(seq_b, seq_b.num_uncomputed_tokens)
print(seq_a)  # status stays "waiting": no scheduler is involved in this notebook
print(seq_b)
draw([seq_a, seq_b], "after both prompts are computed")

# %% [markdown]
# ## Both grow, one token per step
#
# Each decode step appends one sampled token (here: the next integer) and computes it. A
# sequence needs a new block only when it crosses a block boundary, so A and B take turns
# grabbing blocks from the free list: their blocks interleave in the pool. That is fine,
# because every read goes through the block table.

# %% tags=["figure-block-tables"]
for _ in range(5):
    for seq in (seq_a, seq_b):
        seq.token_ids.append(seq.token_ids[-1] + 1)  # the "sampled" token
        compute(seq, 1)
    print(f"A blocks {seq_a.block_table}   B blocks {seq_b.block_table}   "
          f"free {manager.num_free_blocks}")  # fmt: skip
draw([seq_a, seq_b], "after 5 decode steps")

# %% [markdown]
# The invariant the engine keeps for every sequence between steps (see `sequence.py`):
# the block table holds exactly `ceil(num_computed_tokens / block_size)` blocks.

# %%
for seq in (seq_a, seq_b):
    assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / BLOCK_SIZE)
    print(seq.request_id, seq.num_computed_tokens, "tokens ->", len(seq.block_table), "blocks")

# %% [markdown]
# ## B leaves: nothing moves
#
# When a request finishes, its blocks go back to the free list. A's data stays exactly
# where it was: same tensor, same storage, same values. No compaction, no copy.

# %%
a_blocks = list(seq_a.block_table)
a_before = key_cache[a_blocks].clone()
storage_before = key_cache.untyped_storage().data_ptr()

manager.free(seq_b)

assert torch.allclose(key_cache[a_blocks], a_before, equal_nan=True)  # same values
assert key_cache.untyped_storage().data_ptr() == storage_before
print("A's block table:", seq_a.block_table, "(unchanged)")
print("free list now:", list(manager.allocator.free_block_ids))
draw([seq_a], "B finished: its blocks are free, A is untouched")

# %% [markdown]
# ## C arrives and reuses the space
#
# The free list is first-in, first-out: C first gets the blocks nobody has used yet, then
# B's old blocks. C's tokens overwrite B's stale values slot by slot.

# %%
seq_c = new_request("C", first_token=70, prompt_len=22)
compute(seq_c, seq_c.num_uncomputed_tokens)
print(seq_c)
draw([seq_a, seq_c], "C reuses free blocks, wherever they are")

# %% [markdown]
# ## Sharing a block
#
# Reference counts let two block tables point at the same physical block. This is what
# prefix caching does with the full blocks of a shared prompt prefix (notebook 4): request
# D starts with the same first 4 tokens as A, so its table can point at A's first block
# instead of computing and storing those tokens again. Only *full* blocks are shared, so
# nobody ever writes into a shared block.
#
# Here we do by hand what the prefix cache does: `BlockAllocator.touch` takes one more
# reference on A's first block, then D allocates the rest as usual.

# %%
seq_d = Sequence("D", seq_a.token_ids[:4] + [95, 96, 97], SamplingParams())
shared = seq_a.block_table[0]
manager.allocator.touch(shared)  # one more block table holds it: ref count + 1
seq_d.block_table.append(shared)
seq_d.num_computed_tokens = 4  # its K/V are already in the cache
compute(seq_d, seq_d.num_uncomputed_tokens)
print("ref count of block", shared, "=", manager.allocator.ref_counts[shared])
draw([seq_a, seq_c, seq_d], "D shares A's first block")

# %% [markdown]
# Freeing drops one reference. The shared block returns to the free list only when the last
# holder lets go.

# %%
manager.free(seq_a)
print("after A leaves, ref count of block", shared, "=", manager.allocator.ref_counts[shared],
      "; free:", shared in manager.allocator.free_block_ids)  # fmt: skip
manager.free(seq_d)
manager.free(seq_c)
print("after D and C leave: free blocks", manager.num_free_blocks, "of", NUM_BLOCKS)
assert manager.num_free_blocks == NUM_BLOCKS

# %% [markdown]
# ## Forking a sequence: beams share their past
#
# Beam search keeps `k` candidate continuations (beams) of one prompt. At every step each
# beam proposes its best next tokens, the best `k` of all proposals survive, and a beam
# whose proposals win twice **forks** in two. The two beams have the same past: same
# tokens, hence the same keys and values. PagedAttention (section 4.4 of the paper) does
# not copy that past. `KVCacheManager.fork(parent, child)` gives the child the parent's
# whole block table, the last, *partly filled* block included, and adds one reference to
# every block.
#
# The new tokens must not be written into a block someone else still reads. So the first
# beam to write into the shared partial block gets a fresh block instead, with the old
# block's contents copied in: **copy-on-write**. `allocate_slots` notices the shared last
# block (reference count above 1), takes a free block, drops one reference to the old one
# and records the copy `(src, dst)` in `blocks_to_copy`; the model runner copies the block
# in every layer before the step's forward (`compute` above does it for our stand-in
# cache). Full blocks are never written again, so they are never copied.
#
# A 6-token prompt, computed into one full block and one half-full block:


# %%
def ref_counts(seqs: list[Sequence]) -> dict[int, int]:
    """Reference count of every block the sequences hold, in block table order."""
    blocks = dict.fromkeys(b for seq in seqs for b in seq.block_table)
    return {b: manager.allocator.ref_counts[b] for b in blocks}


def snapshot(title: str, seqs: list[Sequence]) -> dict:
    """What the figure below draws: each block table, each block's count and contents."""
    counts = ref_counts(seqs)
    written = dict.fromkeys(counts, 0)  # slots a holder has computed; the rest is stale
    for seq in seqs:
        for j, b in enumerate(seq.block_table):
            written[b] = max(written[b], min(BLOCK_SIZE, seq.num_computed_tokens - j * BLOCK_SIZE))
    return {
        "title": title,
        "tables": {seq.request_id: list(seq.block_table) for seq in seqs},
        "ref_counts": counts,
        "tokens": {b: key_cache[b, : written[b], 0, 0].tolist() for b in counts},
    }


beam_0 = new_request("beam 0", first_token=10, prompt_len=6)
compute(beam_0, beam_0.num_uncomputed_tokens)
print("beam 0 blocks", beam_0.block_table, " ref counts", ref_counts([beam_0]))
snapshots = [snapshot("1. the prompt is computed", [beam_0])]

# %% [markdown]
# The prompt's logits give two good first tokens, 16 and 26: the beam forks. Nothing is
# copied and nothing is allocated; every block now has two holders.

# %%
free_before = manager.num_free_blocks
beam_1 = Sequence("beam 1", beam_0.token_ids[:6], SamplingParams())
assert manager.fork(beam_0, beam_1)
beam_0.token_ids.append(16)  # each beam's own next token, not computed yet
beam_1.token_ids.append(26)
print("beam 0 blocks", beam_0.block_table, " beam 1 blocks", beam_1.block_table)
print("ref counts", ref_counts([beam_0, beam_1]), " blocks allocated by the fork:",
      free_before - manager.num_free_blocks)  # fmt: skip
snapshots.append(snapshot("2. fork: one table more, every count + 1", [beam_0, beam_1]))

# %% [markdown]
# Beam 0 computes its token 16, at position 6: inside the shared half-full block. It gets
# a copy of that block, writes there, and the original keeps beam 1's view. Then beam 1
# computes its token 26: it is now the only holder of the original block, so it writes in
# place, with no copy.

# %%
shared_partial = beam_0.block_table[-1]
compute(beam_0, 1)
print("beam 0 blocks", beam_0.block_table, " (copy of block", shared_partial, ")")
compute(beam_1, 1)
print("beam 1 blocks", beam_1.block_table, " (wrote in place)")
print("ref counts", ref_counts([beam_0, beam_1]))
assert beam_0.block_table[0] == beam_1.block_table[0]  # the full block: still shared
assert beam_0.block_table[1] != beam_1.block_table[1]
snapshots.append(snapshot("3. copy-on-write: beam 0 writes into a copy", [beam_0, beam_1]))


# %% [markdown]
# The three states side by side: the block tables on top, the blocks below with their
# reference counts and the token ids our stand-in cache holds in each slot.


# %% tags=["figure-beam-fork"]
def draw_fork(snapshots: list[dict]) -> None:
    width = max(len(snap["ref_counts"]) for snap in snapshots) * (BLOCK_SIZE + 1)
    fig, axes = plt.subplots(1, len(snapshots), figsize=(4.6 * len(snapshots), 2.9))
    for ax, snap in zip(axes, snapshots, strict=True):
        ax.set_title(snap["title"], fontsize=10)
        ax.axis("off")
        ax.set_xlim(-2.2, width)
        ax.set_ylim(-2.2, 2.1)
        for row, (name, table) in enumerate(snap["tables"].items()):
            y = 1.2 - row
            ax.text(-0.2, y + 0.35, name, ha="right", va="center", color=COLORS[row])
            for j, b in enumerate(table):
                x = j * (BLOCK_SIZE + 1)
                ax.add_patch(Rectangle((x, y), BLOCK_SIZE, 0.7, fc=COLORS[row], alpha=0.35,
                                       ec="k"))  # fmt: skip
                ax.text(x + BLOCK_SIZE / 2, y + 0.35, f"→ block {b}", ha="center", va="center")
        ax.text(-0.2, -1.0, "pool", ha="right", va="center", color="0.3")
        for i, (b, count) in enumerate(snap["ref_counts"].items()):
            x, y = i * (BLOCK_SIZE + 1), -1.4
            tokens = snap["tokens"][b]
            for slot in range(BLOCK_SIZE):
                ax.add_patch(Rectangle((x + slot, y), 1, 0.8, fc="white", ec="k", lw=0.5))
                if slot < len(tokens):
                    ax.text(x + slot + 0.5, y + 0.4, int(tokens[slot]), ha="center",
                            va="center", fontsize=8)  # fmt: skip
            ax.text(x + BLOCK_SIZE / 2, y - 0.4, f"block {b}: ref {count}", ha="center",
                    fontsize=9, color="tab:red" if count > 1 else "k")  # fmt: skip
    fig.suptitle("Two beams fork: block tables and reference counts", fontsize=11)
    plt.tight_layout()
    plt.show()


draw_fork(snapshots)

# %% [markdown]
# When beam search drops a beam, it frees it like any finished request: each of its blocks
# loses one reference, and only blocks nobody else holds go back to the pool.

# %%
manager.free(beam_1)
print("after beam 1 is dropped: ref counts", ref_counts([beam_0]),
      " free", manager.num_free_blocks, "of", NUM_BLOCKS)  # fmt: skip
manager.free(beam_0)
assert manager.num_free_blocks == NUM_BLOCKS

# %% [markdown]
# What sharing saves grows with the width. Fork one 9-token prompt into 4 beams, once
# sharing blocks and once with `share_forked_blocks=False`, which copies every block on a
# fork, as a cache without shared paging must:

# %%
for share in (True, False):
    pool = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, share_forked_blocks=share)
    root = new_request("root", first_token=10, prompt_len=9)
    assert pool.allocate_slots(root, 9)
    root.num_computed_tokens = 9
    for i in range(1, 4):
        assert pool.fork(root, Sequence(f"beam {i}", root.token_ids, SamplingParams()))
    print(f"share_forked_blocks={share}: 4 beams hold {pool.allocator.num_used_blocks} "
          f"blocks, {len(pool.take_blocks_to_copy())} copied")  # fmt: skip


# %% [markdown]
# ## Paged vs contiguous reservation
#
# A traditional server does not know how long an answer will be, so it reserves a
# contiguous region of `max_model_len` slots per request up front. A paged cache only holds
# what a request has actually computed, rounded up to a whole block. The waste of paging is
# the unused tail of each request's last block (*internal fragmentation*): fewer than
# `block_size` slots per request.
#
# Below: 1,000 requests whose final lengths (prompt + output) are drawn uniformly between
# 20 and 600 tokens (seed 0), with `max_model_len = 2048`.

# %%
rng = random.Random(0)
lengths = [rng.randint(20, 600) for _ in range(1000)]
MAX_MODEL_LEN = 2048
used = sum(lengths)
contiguous = MAX_MODEL_LEN * len(lengths)
print(f"tokens actually stored:     {used:>10,}")
print(f"contiguous reservation:     {contiguous:>10,} slots -> {used / contiguous:6.1%} used")
for block_size in (1, 4, 16, 64, 256):
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    print(f"paged, block_size={block_size:>3}:     {paged:>10,} slots -> {used / paged:6.1%} used")

# %% [markdown]
# What that means for the real model. One token of SmolLM2-135M needs a key and a value
# vector per layer and per KV head; with the default 1 GiB cache (`EngineConfig`), how many
# requests of this workload fit at once?

# %%
import json  # noqa: E402

from minivllm.config import DEFAULT_KV_CACHE_BYTES  # noqa: E402
from minivllm.models.model_files import default_model_path  # noqa: E402

config = json.loads((default_model_path() / "config.json").read_text())
bytes_per_token = (
    2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
)  # K and V, fp32
pool_tokens = DEFAULT_KV_CACHE_BYTES // bytes_per_token
mean_len = sum(lengths) / len(lengths)
mean_paged = sum(math.ceil(n / 16) * 16 for n in lengths) / len(lengths)
print(f"SmolLM2 KV cache: {bytes_per_token / 1024:.0f} KiB per token (fp32); "
      f"1 GiB holds {pool_tokens:,} tokens")  # fmt: skip
print(f"contiguous ({MAX_MODEL_LEN} slots each): {pool_tokens // MAX_MODEL_LEN} requests at once")
print(f"paged (block_size 16, mean {mean_paged:.0f} slots each): "
      f"{int(pool_tokens // mean_paged)} requests at once")  # fmt: skip

# %% [markdown]
# Smaller blocks waste less, but make block tables longer (more metadata per step, more
# scattered memory reads in the attention kernel). vLLM and minivllm default to 16.

# %% tags=["figure-fragmentation"]
block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
waste = [1 - used / sum(math.ceil(n / b) * b for n in lengths) for b in block_sizes]
table_len = [sum(math.ceil(n / b) for n in lengths) / len(lengths) for b in block_sizes]

fig, ax1 = plt.subplots(figsize=(7, 3.5))
ax1.plot(block_sizes, [100 * w for w in waste], "o-", color="tab:red")
ax1.set_xscale("log", base=2)
ax1.set_xlabel("block_size (tokens)")
ax1.set_ylabel("slots wasted (%)", color="tab:red")
ax1.axhline(100 * (1 - used / contiguous), ls="--", color="0.5")
ax1.text(3, 100 * (1 - used / contiguous) - 7, "contiguous max_model_len reservation", color="0.4")
ax2 = ax1.twinx()
ax2.plot(block_sizes, table_len, "s-", color="tab:blue")
ax2.set_yscale("log")
ax2.set_ylabel("mean block table length", color="tab:blue")
ax1.set_title("internal fragmentation vs block table length (1,000 requests, seed 0)")
plt.tight_layout()
plt.show()

# %% [markdown]
# **What to remember**
#
# - The cache is allocated once; requests own *block ids*, not memory regions.
# - Token `pos` of a request lives at slot
#   `block_table[pos // block_size] * block_size + pos % block_size`.
# - Joining, growing, leaving and sharing only edit block tables and reference counts.
# - A fork shares every block of its parent; the one shared partly filled block is copied
#   when one of the two first writes into it (copy-on-write).
# - Waste is bounded by one partly filled block per request, instead of the unused part of
#   a `max_model_len` reservation.
#
# Next: [notebook 2](02_engine_steps.ipynb) runs the real engine and shows where these
# block tables go in a step.
