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
# # 2. One engine step at a time
#
# `LLM.generate` hides a loop: `while engine.has_unfinished_requests(): engine.step()`.
# Here we drive that loop by hand on the real model, SmolLM2-135M-Instruct, and look at
# every decision the scheduler makes. We add requests while others are running, and then
# open up one step to see the flat tensors the model actually receives.
#
# To make the decisions visible we use a tiny token budget: at most
# `max_num_batched_tokens = 32` tokens per step, and at most `max_num_seqs = 3` requests
# running at once.

# %%
import time

import matplotlib.pyplot as plt

from minivllm import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from minivllm.structured_output.backend import allowed_tokens

start = time.perf_counter()
# Prefix caching (on by default, as in vLLM) is off here: the four prompts share the chat
# template's system prompt, and this notebook shows every prefill token being computed.
# Everything else is the default. On a CPU that includes synchronous scheduling (async
# scheduling overlaps with a GPU's work, and is on by default only there): each `step()`
# reports the batch it scheduled, and `engine.step_fn` says which step function runs.
engine = LLMEngine(
    EngineConfig(
        max_num_batched_tokens=32, max_num_seqs=3, num_kv_blocks=64,
        enable_prefix_caching=False,
    )
)  # fmt: skip
print(f"SmolLM2 loaded in {time.perf_counter() - start:.1f} s; "
      f"KV pool: {engine.num_kv_blocks} blocks of {engine.config.block_size} tokens; "
      f"step function: {engine.step_fn.__name__}")  # fmt: skip

# %% [markdown]
# Prompts go through the model's chat template, exactly as `LLM.chat` does it. Greedy
# decoding (`temperature=0`) makes the run reproducible.

# %%
tokenizer = engine.get_tokenizer()


def chat_prompt(question: str) -> dict:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return {"prompt": text, "prompt_token_ids": tokenizer(text).input_ids}


questions = {
    "A": "What is continuous batching?",
    "B": "Name three prime numbers.",
    "C": "Explain, in two short paragraphs, why an operating system uses virtual memory "
    "pages instead of giving every program one contiguous piece of physical memory.",
    "D": "Write a haiku about paging.",
}
prompts = {rid: chat_prompt(q) for rid, q in questions.items()}
# Different output lengths, so that requests finish at different steps.
max_tokens = {"A": 16, "B": 20, "C": 12, "D": 8}
params = {rid: SamplingParams(temperature=0, max_tokens=n) for rid, n in max_tokens.items()}
for rid, prompt in prompts.items():
    print(f"{rid}: {len(prompt['prompt_token_ids'])} prompt tokens, max_tokens={max_tokens[rid]}")


# %% [markdown]
# ## The loop
#
# After each `engine.step()`, `engine.last_step` is the scheduler's decision for that step
# (a `SchedulerOutput`): one `ScheduledChunk` per request it ran (`chunks`: the token ids,
# the position of the first, the block table), how many tokens of each request
# (`num_scheduled_tokens`), whether each was a *prefill* (catching up on known tokens, the
# prompt) or a *decode* (the one token sampled last step) in `is_prefill`, and any
# sequence it `preempted`. A chunk covers positions `start_position ..
# start_position + len(token_ids) - 1`.
#
# A and B arrive first. C arrives before step 4, D before step 6.


# %%
def describe(step: int) -> dict:
    scheduled = engine.last_step
    parts = []
    for chunk in scheduled.chunks:
        start, end = chunk.start_position, chunk.context_len - 1
        if scheduled.is_prefill[chunk.request_id]:
            parts.append(f"{chunk.request_id} prefill {start}..{end}")
        else:
            parts.append(f"{chunk.request_id} decode")
    stats = engine.stats()
    print(f"step {step:2d} | {scheduled.total_num_scheduled_tokens:2d} tokens | "
          f"running {stats['num_running']} waiting {stats['num_waiting']} | "
          f"free blocks {stats['num_free_blocks']:2d} | " + ", ".join(parts))  # fmt: skip
    return {
        "prefill": scheduled.num_prefill_tokens,
        "decode": scheduled.num_decode_tokens,
        "seqs": len(scheduled.chunks),
        "waiting": stats["num_waiting"],
    }


arrivals = {0: ["A", "B"], 3: ["C"], 5: ["D"]}
history, texts, step = [], {}, 0
while step == 0 or engine.has_unfinished_requests():
    for rid in arrivals.get(step, []):
        engine.add_request(rid, prompts[rid], params[rid])
        print(f"        + request {rid} arrives")
    finished = []
    for output in engine.step():
        texts[output.request_id] = output.outputs[0].text
        if output.finished:
            finished.append(f"{output.request_id} ({output.outputs[0].finish_reason})")
    step += 1
    history.append(describe(step))
    if finished:
        print("        - finished in this step:", ", ".join(finished))

# %% [markdown]
# Things to notice in the log:
#
# - **Chunked prefill.** A's 36-token prompt does not fit in a 32-token step: 32 tokens run
#   in step 1 and the last 4 in step 2, where B's prompt takes what is left of the budget.
# - **Mixed steps.** From step 3 on, decodes (one token each) and prefill chunks share a
#   step. Running sequences are served first, so a long prompt arriving (C) only gets the
#   budget the decodes leave: A and B keep producing a token every step while C is
#   prefilled. That is why chunking avoids *decode starvation*.
# - **Join and leave at any step.** D waits (`waiting 1`) only because `max_num_seqs = 3`;
#   it starts in the step after one of the others finishes, not when the whole batch is
#   done.
# - A sequence samples a token only when its chunk reaches its last known token. A prefill
#   chunk that ends mid-prompt produces no token.
#
# The same thing as a picture: tokens per step split into prefill and decode, and the
# number of sequences in the batch.

# %% tags=["figure-scheduler-steps"]
steps = range(1, len(history) + 1)
prefill = [h["prefill"] for h in history]
decode = [h["decode"] for h in history]
fig, ax = plt.subplots(figsize=(9, 3.5))
ax.bar(steps, decode, color="tab:blue", label="decode tokens")
ax.bar(steps, prefill, bottom=decode, color="tab:orange", label="prefill tokens")
ax.axhline(engine.config.max_num_batched_tokens, ls="--", color="0.5")
ax.text(len(history), engine.config.max_num_batched_tokens + 0.5, "max_num_batched_tokens",
        ha="right", color="0.4")  # fmt: skip
for at, rids in arrivals.items():
    ax.annotate("+" + "".join(rids), (at + 0.6, 34), color="tab:green", fontsize=9)
ax.plot(steps, [h["seqs"] for h in history], "k.-", label="sequences in the step")
ax.set_xlabel("engine step")
ax.set_ylabel("tokens / sequences")
ax.set_ylim(0, 38)
ax.legend(loc="center right")
ax.set_title("what the scheduler put in each step")
plt.tight_layout()
plt.show()

# %%
for rid in questions:
    print(f"--- {rid}: {questions[rid]}\n{texts[rid].strip()}\n")

# %% [markdown]
# After the run, every block is back in the pool:

# %%
print(engine.stats()["num_free_blocks"], "free of", engine.num_kv_blocks)
assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks

# %% [markdown]
# ## Inside one step: the flattened batch
#
# `ModelRunner.prepare_inputs(scheduled)` turns the scheduler's decision into the tensors
# the model sees. There is no batch dimension and no padding: the tokens of all scheduled
# sequences are laid end to end. To look at them we wrap the runner's method so that it
# keeps a copy of what it returns, then replay the first steps of the run above until a
# step mixes decodes with a prefill chunk.

# %%
runner = engine.executor.model_runner
captured = {}
original_prepare_inputs = runner.prepare_inputs


def prepare_inputs_and_keep(scheduled):
    captured["inputs"] = original_prepare_inputs(scheduled)
    # block tables grow after the step: copy them now.
    captured["seqs"] = [(c.request_id, c.start_position, list(c.block_table))
                        for c in scheduled.chunks]  # fmt: skip
    return captured["inputs"]


runner.prepare_inputs = prepare_inputs_and_keep
engine.add_request("A2", prompts["A"], params["A"])
engine.add_request("B2", prompts["B"], params["B"])
for _ in range(3):
    engine.step()
engine.add_request("C2", prompts["C"], params["C"])
engine.step()  # step 4: A2 and B2 decode, C2's first prefill chunk
runner.prepare_inputs = original_prepare_inputs

input_ids, positions, metadata = captured["inputs"]
print("scheduled:", list(engine.last_step.num_scheduled_tokens.items()))
print("input_ids    ", input_ids.tolist())
print("positions    ", positions.tolist())
print("cu_seqlens_q ", metadata.cu_seqlens_q.tolist())
print("context_lens ", metadata.context_lens.tolist())
print("block_tables\n", metadata.block_tables)
print("slot_mapping ", metadata.slot_mapping.tolist())

# %% [markdown]
# How to read these:
#
# - `cu_seqlens_q` are prefix sums of the query lengths: sequence `i` owns rows
#   `cu_seqlens_q[i] : cu_seqlens_q[i+1]` of `input_ids`, `positions` and of every
#   activation tensor inside the model (`[num_tokens, hidden]`).
# - `positions` restart for each sequence: a decode's single row sits at the end of its
#   context; C2's chunk starts at position 0.
# - `context_lens` count the tokens each sequence attends to *including* this step's new
#   ones, so a row at position `p` sees keys `0..p`.
# - `block_tables` is one row per sequence, padded on the right with block 0. Nothing reads
#   a padded entry, because a backend stops at `ceil(context_len / block_size)` blocks.
# - `slot_mapping` says where each new token's K/V are written: the paged address from
#   notebook 1. We check it for every row:

# %%
block_size = engine.config.block_size
cu = metadata.cu_seqlens_q.tolist()
for i, (rid, _computed, table) in enumerate(captured["seqs"]):
    for row in range(cu[i], cu[i + 1]):
        pos = positions[row].item()
        expected = table[pos // block_size] * block_size + pos % block_size
        assert metadata.slot_mapping[row].item() == expected
    chunk = tokenizer.decode(input_ids[cu[i] : cu[i + 1]])
    print(f"{rid}: rows {cu[i]}..{cu[i + 1] - 1}, positions {positions[cu[i]].item()}.."
          f"{positions[cu[i + 1] - 1].item()}, text {chunk[:60]!r}")  # fmt: skip
print("slot_mapping == block_table[pos // block_size] * block_size + pos % block_size: ok")

# %%
for rid in ("A2", "B2", "C2"):
    engine.abort_request(rid)
print("aborted; free blocks:", engine.kv_cache_manager.num_free_blocks)

# %% [markdown]
# ## One mixed step with structured outputs
#
# Constrained requests (`structured_outputs`: a JSON schema, a choice, ...) run in the same
# batch. After scheduling, the engine asks its structured-output manager for one token mask
# per *sampled* row of a constrained request (`engine.last_step.grammar_bitmask`: `rows`
# and one bitmask row each); a free request's row gets no mask, and a prefill chunk that
# does not reach the end of its prompt samples nothing. We add one free request and two
# constrained ones, then step until a step has all three kinds of row.

# %%
schema = {"type": "object", "properties": {"prime": {"type": "integer"}}, "required": ["prime"]}
so_params = {
    "free": SamplingParams(temperature=0, max_tokens=8),
    "json": SamplingParams(temperature=0, max_tokens=8,
                           structured_outputs=StructuredOutputsParams(json=schema)),
    "choice": SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
}  # fmt: skip
for rid, q in (("free", "B"), ("json", "B"), ("choice", "D")):
    engine.add_request(rid, prompts[q], so_params[rid])
for _ in range(12):
    engine.step()
    step, mask = engine.last_step, engine.last_step.grammar_bitmask
    if mask is not None and len(mask.rows) >= 2 and len(step.chunks) == 3:
        break
vocab_size = engine.structured_output.vocab_size
row = 0
for chunk in step.chunks:
    kind = "decode" if chunk.num_output_tokens else "prefill"
    if not chunk.sample:
        print(f"{chunk.request_id:>6}: {kind}, {len(chunk.token_ids)} tokens, samples nothing")
        continue
    if row in mask.rows:
        allowed = allowed_tokens(mask.bitmask[mask.rows.index(row)], vocab_size)
        what = f"masked: {int(allowed.sum())} of {vocab_size} tokens allowed"
    else:
        what = "no mask: all tokens allowed"
    print(f"{chunk.request_id:>6}: {kind}, sampled row {row}, {what}")
    row += 1 + chunk.num_draft_tokens
for rid in so_params:
    engine.abort_request(rid)

# %% [markdown]
# **What to remember**
#
# - A step is a *token budget*, not a phase: decodes first, then prefill chunks of waiting
#   requests, as long as tokens and `max_num_seqs` allow.
# - Requests join and leave between any two steps.
# - The model sees one flat batch per step; `AttentionMetadata` tells attention which rows
#   belong together and where each sequence's keys and values live.
#
# Next: [notebook 1](01_paged_kv_cache.ipynb) if you skipped it, or the tutorial chapter on
# [continuous batching](../tutorial/continuous-batching.md).
