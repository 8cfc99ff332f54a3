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
# # 4. Preemption and prefix caching
#
# Two things the block tables make possible, on the real model:
#
# - **Preemption.** When the KV pool is too small for everyone, the scheduler takes the
#   blocks of the newest running request and recomputes it later. Outputs do not change;
#   only time is lost.
# - **Prefix caching.** Requests that start with the same tokens (a shared system prompt)
#   share the full blocks holding them, instead of computing and storing them again.
#
# One workload for both: five chat requests with the same long system prompt and different
# questions, arriving one per engine step, answered greedily.

# %%
import time

import matplotlib.pyplot as plt

from minivllm import LLMEngine, SamplingParams
from minivllm.config import EngineConfig

SYSTEM = (
    "You are the documentation assistant of minivllm, a small re-implementation of the "
    "core of vLLM. minivllm schedules tokens, not requests: every engine step fills one "
    "token budget with decodes of running requests and chunks of waiting prompts. Keys "
    "and values live in a paged KV cache: fixed-size blocks, block tables, a slot mapping, "
    "and no copies when requests join or leave. Answer in one short sentence, plainly, "
    "for a reader who is learning how inference engines work."
)
QUESTIONS = [
    "What is a block table?",
    "Why is static batching slow?",
    "What does preemption do?",
    "What is a token budget?",
    "What is prefix caching?",
]
PARAMS = SamplingParams(temperature=0, max_tokens=16)


def make_engine(enable_prefix_caching: bool = False, **options) -> LLMEngine:
    """Prefix caching off unless asked: the preemption runs below recompute every token.
    The rest is the default (on a CPU: synchronous steps, each reporting itself)."""
    config = EngineConfig(
        max_num_batched_tokens=256, enable_prefix_caching=enable_prefix_caching, **options
    )
    engine = LLMEngine(config)
    engine.record_steps()  # keep a StepStats per step (minivllm/stats.py)
    return engine


def run(engine: LLMEngine) -> dict:
    """Add one request per step, run to the end; outputs and timings by request id."""
    tokenizer = engine.get_tokenizer()
    pending = list(enumerate(QUESTIONS))
    outputs, start = {}, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if pending:
            i, question = pending.pop(0)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            engine.add_request(
                str(i), {"prompt": text, "prompt_token_ids": tokenizer(text).input_ids}, PARAMS
            )
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    steps = engine.take_step_stats()
    return {"outputs": outputs, "seconds": time.perf_counter() - start, "steps": steps}


# %% [markdown]
# ## A reference run with plenty of memory
#
# The default pool (1 GiB: about 23,000 tokens of SmolLM2) holds everyone at once.

# %%
engine = make_engine()
baseline = run(engine)
prompt_len = len(baseline["outputs"]["0"].prompt_token_ids)
print(f"prompt length ~{prompt_len} tokens; {engine.num_kv_blocks} blocks in the pool")
print(f"{len(baseline['steps'])} steps, {baseline['seconds']:.1f} s, "
      f"preemptions: {engine.stats()['num_preemptions_total']}")  # fmt: skip
for rid, output in sorted(baseline["outputs"].items()):
    print(f"{QUESTIONS[int(rid)]:32} {output.outputs[0].text.strip()[:70]!r}")
del engine

# %% [markdown]
# ## Squeezing the pool until the scheduler preempts
#
# A prompt of about 126 tokens fills 8 blocks of 16; its 16 output tokens need a 9th.
# We give the pool exactly enough for three prompts and nothing more. When a running
# request needs a block and none is free, `Scheduler.schedule` preempts the newest
# running request: frees its blocks, resets its `num_computed_tokens` to 0 and puts it at
# the front of the waiting queue.

# %%
blocks_per_prompt = -(-prompt_len // 16)
blocks_per_request = -(-(prompt_len + PARAMS.max_tokens) // 16)
small_pool = 3 * blocks_per_prompt
engine = make_engine(num_kv_blocks=small_pool)
squeezed = run(engine)
num_preemptions = engine.stats()["num_preemptions_total"]
print(f"{small_pool} blocks ({blocks_per_prompt} per prompt, {blocks_per_request} per finished "
      "request): "
      f"{len(squeezed['steps'])} steps, {squeezed['seconds']:.1f} s, "
      f"{num_preemptions} preemptions")  # fmt: skip
assert num_preemptions > 0

same = all(
    squeezed["outputs"][rid].outputs[0].token_ids == out.outputs[0].token_ids
    for rid, out in baseline["outputs"].items()
)
print("outputs identical to the reference run:", same)
assert same
print("blocks free after the run:", engine.kv_cache_manager.num_free_blocks, "of", small_pool)
del engine

# %% [markdown]
# The picture of that run, one point per step: how many requests were running, waiting
# for the first time, or waiting to be recomputed after a preemption, and how full the
# KV pool was. A request's recompute is one long prefill of its prompt *and* the tokens
# it had already generated.

# %% tags=["figure-preemption"]
steps = squeezed["steps"]
x = range(1, len(steps) + 1)
fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
top.stackplot(
    x,
    [s.num_running for s in steps],
    [s.num_waiting for s in steps],
    [s.num_preempted for s in steps],
    labels=["running", "waiting (new)", "waiting (preempted)"],
    colors=["tab:blue", "tab:gray", "tab:red"],
)
for i, s in enumerate(steps, start=1):
    if s.preempted_ids:
        top.annotate("preempt " + ",".join(s.preempted_ids), (i, len(QUESTIONS) + 0.3), rotation=90,
                     fontsize=7, color="tab:red", va="bottom")  # fmt: skip
top.set_ylabel("requests")
top.set_ylim(0, len(QUESTIONS) + 3)
top.legend(loc="upper right", fontsize=8)
bottom.plot(x, [s.num_kv_blocks_used for s in steps], color="tab:green")
bottom.axhline(small_pool, ls="--", color="0.5")
bottom.text(1, small_pool - 2.5, f"num_kv_blocks = {small_pool}", color="0.4")
bottom.plot(x, [s.num_prefill_tokens / 16 for s in steps], ":", color="tab:orange",
            label="prefill tokens / 16")  # fmt: skip
bottom.set_ylabel("KV blocks in use")
bottom.set_xlabel("engine step")
bottom.legend(loc="lower right", fontsize=8)
top.set_title("a KV pool too small for everyone: preemption by recompute")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Prefix caching: compute the system prompt once
#
# With `enable_prefix_caching=True`, every *full* block gets a name: a hash of its tokens
# chained with the hash of the block before it (`hash_block_tokens` in
# `minivllm/kv_cache_manager.py`). When a request is admitted, the scheduler looks its
# prompt's blocks up in order (`KVCacheManager.get_computed_blocks`) and shares every
# block found, so it starts computing after them. The last prompt token is always
# computed: its logits give the first output token.

# %%
engine = make_engine(enable_prefix_caching=True)
cached = run(engine)
stats = engine.stats()
print(f"{len(cached['steps'])} steps, {cached['seconds']:.1f} s")
print(f"prefix cache: {stats['prefix_cache_hit_tokens']} of {stats['prefix_cache_query_tokens']} "
      f"prompt tokens were hits ({stats['prefix_cache_hit_rate']:.0%})")  # fmt: skip
for rid, output in sorted(cached["outputs"].items()):
    print(f"request {rid}: {output.num_cached_tokens:3d} of {len(output.prompt_token_ids)} "
          "prompt tokens from the cache")  # fmt: skip
same = all(
    cached["outputs"][rid].outputs[0].token_ids == out.outputs[0].token_ids
    for rid, out in baseline["outputs"].items()
)
print("outputs identical to the reference run:", same)
assert same
# Request 0 computes the system prompt; every later one shares at least its full blocks.
assert cached["outputs"]["0"].num_cached_tokens == 0
assert all(cached["outputs"][rid].num_cached_tokens >= 16 for rid in "1234")
del engine

# %% [markdown]
# Request 0 finds nothing: it is the first to compute the system prompt. Every later one
# shares the full blocks of the system prompt. What that saves, counted from the step
# log (prefill token rows the model computed) and timed on this run:

# %%
for name, result in [("no prefix caching", baseline), ("prefix caching", cached)]:
    prefill = sum(s.num_prefill_tokens for s in result["steps"])
    print(f"{name:18}: {prefill:5d} prefill tokens computed, {result['seconds']:5.1f} s")
saved = sum(s.num_prefill_tokens for s in baseline["steps"]) - sum(
    s.num_prefill_tokens for s in cached["steps"]
)
assert saved == stats["prefix_cache_hit_tokens"] > 0  # every hit is a prefill row not computed

# %% [markdown]
# The prefill tokens saved are exact. The time saved is small here: on this CPU, prefilling
# about 110 tokens costs roughly as much as a few decode steps, so other programs on the
# machine can hide it. Prefix caching pays most with long shared prefixes (few-shot
# examples, documents, long system prompts) and many requests; see the
# [results page](../tutorial/results.md) for a larger run.

# %% [markdown]
# **What to remember**
#
# - Preemption by recompute trades time for memory: the victim's blocks are freed at once,
#   and it later recomputes everything it had, producing the same tokens.
# - Prefix caching shares full blocks by content. Reference counts keep a shared block
#   alive; a freed cached block stays reusable until the allocator needs the space (least
#   recently freed first).
# - Both are block-table operations. Neither moves a single key or value in the cache.
