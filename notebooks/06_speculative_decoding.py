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
# # 6. Speculative decoding meets continuous batching
#
# A decode step computes one token row per request, yet on a CPU (or a GPU) it costs about
# as much as computing several: the step is bound by reading the weights, not by the
# arithmetic. Speculative decoding spends that slack. A request brings *draft tokens*,
# guesses for its next few tokens; the step computes them as extra rows, and the model's
# own outputs at those rows say which guesses were right.
#
# minivllm does it vLLM v1's way:
#
# - the drafts come from the request's own tokens (**n-gram / prompt lookup**: the last
#   few tokens occurred earlier; guess that what followed then follows now);
# - the scheduler schedules a decode with `d` drafts as `1 + d` tokens of the same
#   token budget, in the same flattened batch as everyone's prefills and decodes;
# - the **rejection sampler** keeps the longest run of drafts the model agrees with, plus
#   one token of its own, so greedy outputs are exactly those of plain decoding;
# - rejected drafts are rolled back: `num_computed_tokens` moves back, their blocks
#   return to the pool, and no block holding one is ever put in the prefix cache.
#
# This notebook runs it on SmolLM2, then measures *why* it stops paying in big batches.

# %%
import time

import matplotlib.pyplot as plt
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.chat import chat_prompt
from minivllm.config import EngineConfig
from minivllm.spec_decode import NgramProposer

# One torch thread: on a machine shared with other busy processes, threads that wait on
# each other at every small op make step times swing; one thread keeps them comparable.
torch.set_num_threads(1)

# %% [markdown]
# ## The proposer
#
# `NgramProposer(k, prompt_lookup_min, prompt_lookup_max)` looks the last `n` tokens up
# in the earlier ones, for `n` from max down to min, and proposes the `k` tokens that
# followed the earliest match. vLLM's docstring example:

# %%
proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
print(proposer.propose([1, 2, 3, 4, 2, 3]))  # [2, 3] occurred at index 1: propose 4, 2, 3

# %% [markdown]
# ## One copy-heavy request, with and without drafts
#
# "Repeat this passage": the answer copies the prompt, the best case for prompt lookup.
# One request (`max_num_seqs=1`), greedy, 64 tokens at most, `k = 3` drafts.

# %%
PASSAGE = (
    "Paged attention stores the keys and values of every request in fixed-size blocks. "
    "A block table maps each request's token positions to blocks, so requests can join "
    "and leave the batch without copying memory, and the scheduler can fill every step "
    "with useful work."
)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}  # fmt: skip
PARAMS = SamplingParams(temperature=0, max_tokens=64)


def make_engine(**options) -> LLMEngine:
    # One request at a time, and synchronous steps in both runs (the default on a CPU;
    # speculative decoding has no async scheduling), so their step counts compare.
    config = EngineConfig(max_num_seqs=1, enable_prefix_caching=False, **options)
    return LLMEngine(config)


def run_one(engine: LLMEngine, text: str):
    """Generate for one chat prompt; returns the output, the wall time, and for every step
    the (drafts scheduled, tokens emitted) pair of the request."""
    prompt = chat_prompt(engine.get_tokenizer(), [{"role": "user", "content": text}])
    engine.add_request("0", prompt, PARAMS)
    trace, output = [], None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.scheduler.requests["0"].num_output_tokens
        for out in engine.step():
            output = out
        drafts = engine.last_step.scheduled_spec_decode_tokens.get("0", [])
        trace.append((len(drafts), len(output.outputs[0].token_ids) - before))
    return output, time.perf_counter() - start, trace


task = f"Repeat this passage exactly:\n\n{PASSAGE}"
plain_engine, spec_engine = make_engine(), make_engine(speculative_config=SPEC)
run_one(plain_engine, "Hi")  # warm-up both engines
run_one(spec_engine, "Hi")
plain_s = spec_s = float("inf")
for _ in range(2):  # alternate, keep each one's best time (other processes only add time)
    plain, seconds, plain_trace = run_one(plain_engine, task)
    plain_s = min(plain_s, seconds)
    spec, seconds, spec_trace = run_one(spec_engine, task)
    spec_s = min(spec_s, seconds)
same = plain.outputs[0].token_ids == spec.outputs[0].token_ids
n = len(spec.outputs[0].token_ids)
print(spec.outputs[0].text[:200], "...")
print(f"\ngreedy outputs identical: {same} ({n} tokens)")
print(f"steps: {len(plain_trace)} without drafts, {len(spec_trace)} with")
print(f"output tokens/s: {n / plain_s:.1f} -> {n / spec_s:.1f} ({plain_s / spec_s:.2f}x)")

# %% [markdown]
# The engine's stats carry vLLM's counters (`vllm:spec_decode_num_drafts`,
# `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`)
# and the derived rates. The *mean acceptance length* counts the bonus / corrected token,
# so it is the tokens one verification step emits.

# %%
stats = spec_engine.stats()
for key, value in stats.items():
    if key.startswith("spec_decode"):
        print(f"{key:42s} {value}")

# %% tags=["figure-spec-decode-trace"]
fig, ax = plt.subplots(figsize=(9, 2.8))
steps = list(range(len(spec_trace)))
ax.bar([x - 0.2 for x in steps], [d + 1 for d, _ in spec_trace], width=0.4,
       color="lightgray", label="decode rows: 1 + drafts")  # fmt: skip
ax.bar([x + 0.2 for x in steps], [e for _, e in spec_trace], width=0.4,
       color="tab:blue", label="tokens emitted")  # fmt: skip
ax.set_xlabel("engine step (the first is the prefill)")
ax.set_ylabel("tokens")
ax.set_title("One copy-heavy request, k = 3: rows computed vs tokens kept, per step")
ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# ## Where it stops paying: step time against token rows
#
# A verification step with `B` requests and `d` drafts each computes `B (1 + d)` rows.
# It pays only while a step's time `T(rows)` barely grows with its rows: then it emits
# `E` (the mean acceptance length) tokens per request for the price of one. Once `T` grows
# in proportion to the rows, each extra row costs as much as a plain decode token, and a
# rejected draft is pure loss. So the crossover is read off `T(n)`.
#
# Measured here: the time of one engine step whose only work is a single `n`-token
# chunk (a request's prompt). The matmuls dominate both a chunk and a batch of decodes of
# short context, so this is the curve a decode batch of `n` rows follows too. Each `n` is
# timed in 5 interleaved rounds and the *minimum* kept: on a shared machine, other
# processes only ever add time.

# %%
# No prefix caching: the same prompt is timed again and again, and must be computed each time.
timing_engine = LLMEngine(EngineConfig(max_num_batched_tokens=512, enable_prefix_caching=False))
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def one_step(num_rows: int, i: int) -> float:
    prompt = {"prompt_token_ids": [1000 + (7 * j + i) % 5000 for j in range(num_rows)]}
    timing_engine.add_request(f"{num_rows}-{i}", prompt, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    timing_engine.step()  # the whole prompt in one chunk: num_rows rows
    elapsed = time.perf_counter() - start
    while timing_engine.has_unfinished_requests():
        timing_engine.step()
    return elapsed


one_step(8, -1)  # warm-up
samples = {n: [] for n in ROWS}
for i in range(5):
    for n in ROWS:
        samples[n].append(one_step(n, i))
T = {n: min(times) for n, times in samples.items()}
for n, t in T.items():
    print(f"{n:4d} rows: {1000 * t:7.1f} ms per step, {1000 * t / n:6.2f} ms per row")

# %% [markdown]
# Reading the curve: while the step time grows much slower than the rows, the step is
# bound by reading the weights (~540 MB in fp32), and extra rows are nearly free; where
# the time per row stops falling, the arithmetic dominates and every row costs the same.
# The model below predicts the speedup of speculation at batch size `B` from this curve
# and the acceptance measured above:
#
# `speedup(B) ≈ E · T(B) / T(B · (1 + d̄))`, with `E` the mean acceptance length and
# `d̄` the mean number of drafts per verification.

# %%
E = stats["spec_decode_mean_acceptance_length"]
d_bar = stats["spec_decode_num_draft_tokens"] / max(1, stats["spec_decode_num_drafts"])


def interpolate(n: float) -> float:
    """T at n rows, linear between measured points (and beyond the last one)."""
    points = sorted(T.items())
    for (n0, t0), (n1, t1) in zip(points, points[1:]):
        if n <= n1 or (n1, t1) == points[-1]:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    return points[-1][1]


batch_sizes = [1, 2, 4, 8, 16, 32, 64]
predicted = [E * T.get(b, interpolate(b)) / interpolate(b * (1 + d_bar)) for b in batch_sizes]
for b, s in zip(batch_sizes, predicted):
    print(f"B = {b:3d}: predicted speedup {s:.2f}x")

# %% tags=["figure-spec-decode-step-time"]
fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 3.6))
ax_t.plot(list(T), [1000 * t for t in T.values()], marker="o")
ax_t.set_xscale("log", base=2)
ax_t.set_yscale("log")
ax_t.set_xlabel("token rows in the step")
ax_t.set_ylabel("step time (ms)")
ax_t.set_title("T(n): step time against token rows (best of 5)")
ax_s.plot(batch_sizes, predicted, marker="o", color="tab:green")
ax_s.axhline(1.0, color="gray", lw=0.8)
ax_s.set_xscale("log", base=2)
ax_s.set_xlabel("decoding requests in the batch (B)")
ax_s.set_ylabel("predicted speedup")
ax_s.set_title(f"E = {E:.2f} tokens per verification, {d_bar:.1f} drafts")
fig.tight_layout()
plt.show()

# %% [markdown]
# The measured end-to-end version (two workloads, `max_num_seqs` = 1, 4, 16, 64) is
# `benchmarks/spec_decode.py`; its results and the crossover it found are in the
# tutorial chapter *Speculative decoding*.
