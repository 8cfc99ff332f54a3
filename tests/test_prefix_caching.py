"""Automatic prefix caching: block hashes, hits, eviction, and outputs unchanged by it.

The first half drives `KVCacheManager` directly with hand-made sequences; the second runs
the whole engine on tiny random checkpoints (and SmolLM2, marked slow) and checks that
greedy outputs are token-for-token the same with prefix caching on and off.
"""

import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kv_cache_manager import KVCacheManager, hash_block_tokens
from minivllm.sequence import Sequence
from minivllm.utils import cdiv
from tests.helpers import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, token_ids, SamplingParams())


def compute(manager, seq, num_tokens, computed_blocks=None):
    """What one scheduler step + model step do to ``seq``: allocate (sharing
    ``computed_blocks`` if it is being admitted), compute, register the full blocks."""
    assert manager.allocate_slots(seq, num_tokens, computed_blocks)
    seq.num_computed_tokens += len(computed_blocks or []) * manager.block_size + num_tokens
    manager.cache_full_blocks(seq)
    assert len(seq.block_table) == cdiv(seq.num_computed_tokens, manager.block_size)


def admit(manager, seq):
    """Admit ``seq`` like the scheduler does: share its cached prefix, compute the rest."""
    hit = manager.get_computed_blocks(seq)
    compute(manager, seq, seq.num_tokens - len(hit) * manager.block_size, hit)
    return hit


# --- the manager on its own ------------------------------------------------------------------


def test_block_hash_names_the_whole_prefix_not_just_the_block():
    root = hash_block_tokens(b"", [1, 2])
    assert root == hash_block_tokens(b"", [1, 2])
    assert root != hash_block_tokens(b"", [2, 1])
    # The same tokens after a different prefix are different keys and values.
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(
        hash_block_tokens(b"", [9, 9]), [3, 4]
    )


def test_second_request_shares_the_longest_cached_prefix():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(10)), "a")  # blocks [0..3] [4..7] and a partial [8, 9]
    admit(manager, first)
    second = make_seq(list(range(8)) + [50, 51, 52], "b")
    hit = admit(manager, second)
    assert hit == first.block_table[:2]
    assert second.block_table[:2] == first.block_table[:2]
    assert [manager.allocator.ref_counts[b] for b in hit] == [2, 2]
    assert second.block_table[2] not in first.block_table  # the tails are private
    assert manager.prefix_cache_stats.num_hit_tokens == 8
    assert manager.prefix_cache_stats.num_queried_tokens == 10 + 11


def test_a_different_first_block_means_no_hit_at_all():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    admit(manager, make_seq(list(range(12)), "a"))
    # Blocks 2 and 3 of this prompt equal blocks of "a", but their prefix does not.
    assert manager.get_computed_blocks(make_seq([99] + list(range(1, 12)), "b")) == []


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_full_hit_is_capped_to_leave_the_last_token_to_compute(num_blocks_in_prompt):
    """nano-vllm #114: a prompt that is a whole number of cached blocks crashed. The last
    block is recomputed, into a fresh block, so that the last token has logits."""
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(4 * num_blocks_in_prompt))
    first = make_seq(prompt, "a")
    admit(manager, first)
    again = make_seq(prompt, "b")
    hit = admit(manager, again)
    assert len(hit) == num_blocks_in_prompt - 1
    assert again.num_tokens - len(hit) * 4 == 4  # one whole block is computed again
    assert again.block_table[-1] != first.block_table[-1]  # never written while shared


def test_decode_steps_register_the_blocks_they_fill():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3], "a")
    admit(manager, seq)
    assert manager.allocator.num_cached_blocks == 0  # 3 tokens: no full block yet
    for token in (4, 5):  # the sampled tokens, computed by the next decode steps
        seq.token_ids.append(token)
        compute(manager, seq, 1)
    assert manager.allocator.num_cached_blocks == 1
    follower = make_seq([1, 2, 3, 4, 5, 6], "b")  # prompt = a's prompt + a's output
    assert manager.get_computed_blocks(follower) == seq.block_table[:1]


def test_chunked_prefill_registers_each_chunk_and_a_later_request_can_hit_it_midway():
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    long_prompt = list(range(20))
    first = make_seq(long_prompt, "a")
    compute(manager, first, 8, computed_blocks=[])  # the first chunk ends on a block boundary
    assert manager.allocator.num_cached_blocks == 2
    second = make_seq(long_prompt, "b")
    assert manager.get_computed_blocks(second) == first.block_table[:2]
    compute(manager, first, 6)  # a chunk ending mid-block
    assert manager.allocator.num_cached_blocks == 3


def test_freed_cached_blocks_are_hit_until_evicted_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3, 4, 5], "old")  # 2 full blocks + a partial one; 1 block unused
    admit(manager, old)
    first, second, _partial = old.block_table
    manager.free(old)  # freed newest first, so the tail will be evicted first
    assert manager.num_free_blocks == 4
    probe = make_seq([1, 2, 3, 4, 0], "probe")
    assert manager.get_computed_blocks(probe) == [first, second]

    admit(manager, make_seq([7, 7, 7], "x"))  # 2 blocks: the unused one and the partial
    assert manager.get_computed_blocks(probe) == [first, second]
    admit(manager, make_seq([8], "y"))  # evicts the block holding [3, 4]
    assert manager.get_computed_blocks(probe) == [first]
    admit(manager, make_seq([9], "z"))  # evicts the block holding [1, 2]
    assert manager.get_computed_blocks(probe) == []


def test_a_hit_on_free_cached_blocks_counts_against_the_free_pool():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3, 4, 5], "old")
    admit(manager, old)
    manager.free(old)
    # 7 tokens: 2 cached blocks + 2 new ones = all 4 blocks; fits exactly.
    fits = make_seq([1, 2, 3, 4, 9, 9, 9], "fits")
    hit = manager.get_computed_blocks(fits)
    assert len(hit) == 2
    assert manager.allocate_slots(fits, 3, hit)
    manager.free(fits)
    # 9 tokens: 2 cached + 3 new = 5 > 4 blocks. Refused, and nothing is taken.
    too_big = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 9], "too_big")
    hit = manager.get_computed_blocks(too_big)
    stats_before = (manager.prefix_cache_stats.num_queried_tokens,)
    assert not manager.allocate_slots(too_big, 5, hit)
    assert manager.num_free_blocks == 4 and manager.allocator.ref_counts == [0] * 4
    assert too_big.block_table == []
    assert (manager.prefix_cache_stats.num_queried_tokens,) == stats_before  # not admitted


@pytest.mark.parametrize("options", [{"enable_prefix_caching": False}, {}], ids=["off", "default"])
def test_prefix_caching_off_never_hashes_or_hits(options):
    """Off unless asked for."""
    manager = KVCacheManager(num_blocks=8, block_size=2, **options)
    admit(manager, make_seq([1, 2, 3, 4, 5], "a"))
    assert manager.allocator.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_seq([1, 2, 3, 4, 5], "b")) == []
    assert manager.prefix_cache_stats.num_queried_tokens == 0


# --- the whole engine: outputs must not change -----------------------------------------------


def shared_prefix_prompts(num_prompts, prefix_len, seed=0):
    """Prompts that share a ``prefix_len``-token "system prompt", with distinct tails."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(prefix_len)]
    return [
        prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))]
        for _ in range(num_prompts)
    ]


def generate(model_path, prompts, params=GREEDY, **options):
    """Greedy token ids of each prompt, and the `LLM` (for its engine's stats)."""
    llm = LLM(str(model_path), **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], outputs, llm


def generate_on_and_off(model_path, prompts, **options):
    off, _, _ = generate(model_path, prompts, enable_prefix_caching=False, **options)
    on, outputs, llm = generate(model_path, prompts, enable_prefix_caching=True, **options)
    assert on == off
    return outputs, llm


def test_outputs_identical_on_and_off_with_a_shared_prefix(tiny_model_path):
    prompts = shared_prefix_prompts(8, prefix_len=21)
    outputs, llm = generate_on_and_off(
        tiny_model_path, prompts, block_size=4, num_kv_blocks=128, max_num_batched_tokens=48
    )
    stats = llm.llm_engine.stats()
    assert stats["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in outputs) > 0
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(
        stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"]
    )
    assert all(o.num_cached_tokens % 4 == 0 and o.num_cached_tokens <= 20 for o in outputs)


def test_prefix_hit_matches_transformers(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    prompts = shared_prefix_prompts(4, prefix_len=13, seed=1)
    # 16 tokens a step, two sequences at a time: later prompts arrive at a cached prefix.
    ours, outputs, _ = generate(
        tiny_llama_path, prompts, block_size=4, max_num_batched_tokens=16, max_num_seqs=2,
        enable_prefix_caching=True,
    )  # fmt: skip
    assert sum(o.num_cached_tokens for o in outputs) > 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)
    assert ours == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("prompt_len", [8, 9, 12])
def test_a_repeated_prompt_hits_everything_but_its_last_block(tiny_llama_path, prompt_len):
    """A 100 % hit (prompt length a multiple of block_size) must not crash (nano-vllm #114)
    and must give the same output as the first, uncached run."""
    prompt = shared_prefix_prompts(1, prefix_len=prompt_len)[0][:prompt_len]
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=32, enable_prefix_caching=True)
    first, second = (
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0] for _ in range(2)
    )
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (prompt_len - 1) // 4 * 4
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_identical_prompts_in_the_same_step(tiny_model_path):
    prompt = shared_prefix_prompts(1, prefix_len=16)[0][:16]
    outputs, _ = generate_on_and_off(tiny_model_path, [prompt] * 4, block_size=4, num_kv_blocks=64)
    # Blocks are registered when the step is scheduled: requests admitted after the first
    # one in the same step already share its full blocks (all but the last, capped).
    assert [o.num_cached_tokens for o in outputs] == [0, 12, 12, 12]
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1


def test_outputs_identical_when_requests_hit_the_cache_after_preemptions(tiny_model_path):
    """nano-vllm PR #211: a prefix hit after a preemption went out of bounds. A pool far
    too small for the batch forces preemptions; readmitted requests hit the blocks of
    others and their own old ones."""
    prompts = shared_prefix_prompts(6, prefix_len=10, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    off, _, llm_off = generate(tiny_model_path, prompts, params, block_size=4, num_kv_blocks=12)
    on, outputs, llm_on = generate(
        tiny_model_path, prompts, params, block_size=4, num_kv_blocks=12, enable_prefix_caching=True
    )
    assert on == off
    assert llm_on.llm_engine.scheduler.num_preemptions > 0
    assert llm_off.llm_engine.scheduler.num_preemptions > 0
    stats = llm_on.llm_engine.stats()
    # Readmissions are looked up again, output tokens included, so queries exceed prompts.
    assert stats["prefix_cache_query_tokens"] > sum(len(p) for p in prompts)
    # More hits than the first admissions had: some readmitted requests hit the cache.
    assert stats["prefix_cache_hit_tokens"] > sum(o.num_cached_tokens for o in outputs)
    assert stats["num_free_blocks"] == 12  # everything back in the pool, cached or not


def test_a_hit_skips_the_prefill_of_the_cached_tokens(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=32, enable_prefix_caching=True)
    engine = llm.llm_engine
    prompt = list(range(3, 22))  # 19 tokens: 4 full blocks + 3
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    engine.add_request("again", {"prompt_token_ids": prompt + [40, 41]}, GREEDY)
    engine.step()
    assert list(engine.last_step.num_scheduled_tokens.values()) == [21 - 16]


def test_reset_prefix_cache_makes_the_next_run_cold(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), block_size=4, num_kv_blocks=32, enable_prefix_caching=True)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(3, 16))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    engine.add_request("in-flight", prompt, GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False  # a running request holds blocks
    engine.abort_request("in-flight")
    assert engine.stats()["prefix_cache_hit_tokens"] == 12
    assert engine.reset_prefix_cache() is True
    assert engine.stats()["prefix_cache_query_tokens"] == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.slow
def test_smollm2_shared_system_prompt_identical_on_and_off(smollm2_path):
    system = (
        "You are a concise assistant for a bicycle repair shop. Answer in one sentence, "
        "mention the tool needed, and never recommend a competitor."
    )
    questions = ["How do I fix a flat tire?", "My chain squeaks.", "How tight should brakes be?"]
    llm = LLM(str(smollm2_path), enable_prefix_caching=False, max_num_batched_tokens=32)
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    params = SamplingParams(temperature=0, max_tokens=6)
    off = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )]  # fmt: skip
    on, outputs, llm_on = generate(
        smollm2_path, prompts, params, enable_prefix_caching=True, max_num_batched_tokens=32
    )
    assert on == off
    # Each step computes 32 tokens: every later request finds the system prompt cached.
    assert outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in outputs[1:])
    assert llm_on.llm_engine.stats()["prefix_cache_hit_rate"] > 0.3
