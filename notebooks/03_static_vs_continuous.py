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
# # 3. Static vs continuous batching, measured
#
# One workload, two scheduling policies, the same model code, attention backend and batch
# size cap (`max_num_seqs`):
#
# - `scheduling_policy="static"` (`minivllm/static_scheduler.py`): a batch forms only when
#   the previous one has finished; prompts are padded to the batch's longest; finished
#   requests keep computing padding rows until the longest one ends; every request reserves
#   a `max_model_len` region of the KV cache.
# - `scheduling_policy="continuous"` (`minivllm/scheduler.py`): the token-budget scheduler
#   of notebook 2.
#
# The measuring is done by `minivllm.bench`, the package behind the `minivllm bench`
# command. This notebook runs a smaller workload than the command's default, so that it
# finishes in about a minute on a 2-core CPU; the
# [results page](../tutorial/results.md) has the full-size run.

# %%
import platform
import tempfile
import time
from pathlib import Path

import torch
from IPython.display import Image, display

from minivllm.bench import plots, report, run_engine
from minivllm.bench.workloads import LengthDistribution, Workload, synthetic
from minivllm.config import EngineConfig

print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {torch.get_num_threads()} torch threads")

# %% [markdown]
# ## The workload
#
# Sixteen requests, all arriving at t = 0 ("offline"), with random prompt token ids (their
# content does not change the compute, their lengths do) and an exact number of output
# tokens each (`ignore_eos`), so both policies do exactly the same useful work. Lengths
# are drawn uniformly, seed 0: heterogeneous, like real traffic.

# %%
workload = synthetic(
    num_requests=16,
    prompt_len=LengthDistribution.parse("uniform:16:200"),
    output_len=LengthDistribution.parse("uniform:4:32"),
    token_range=(100, 49152),  # skip SmolLM2's special tokens at the start of the vocabulary
    seed=0,
)
print(workload.describe())

# %% [markdown]
# ## Two runs
#
# Both policies get `max_num_seqs = 8`. The static policy reserves, per request, room for
# the workload's longest request (prompt + output), which is what a well-configured static
# server would do; the continuous policy uses a token budget of 256 per step.

# %%
# No prefix caching under either policy (static batching has none): batching alone differs.
common = dict(
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_model_len=workload.max_request_len,
    enable_prefix_caching=False,
)
runs = []
for policy in ("static", "continuous"):
    config = EngineConfig(scheduling_policy=policy, **common)
    runs.append(run_engine(config, workload, progress=False))
    print(f"{policy:>10}: {runs[-1].summary.duration:.1f} s")

# %% [markdown]
# ## The comparison table
#
# Latencies follow vLLM's definitions: *queue* is arrival to first scheduled, *TTFT* is
# arrival to first output token, *TPOT* is the time per output token after the first,
# *ITL* the gaps between consecutive tokens, *E2E* arrival to last token. *Padding waste*
# is the fraction of computed token rows that were padding. *KV utilisation* is tokens
# actually stored over KV slots reserved, averaged over steps.

# %%
print(report.format_table(runs))
agree = report.outputs_agree(runs, "static", "continuous")
print(f"\ngreedy outputs identical under both policies: {agree[0]}/{agree[1]} requests")
# Padding rows never reach a real row's attention (see static_scheduler.py), so greedy
# tokens must match exactly; a mismatch means a scheduling or attention bug.
assert agree[0] == agree[1] == len(workload.requests), agree

# %% [markdown]
# The headline ratios, computed from the runs above (the results page has a full-size
# run; a 16-request run is noisier):

# %%
static, continuous = (run.summary for run in runs)
print(f"throughput, continuous / static: "
      f"{continuous.output_throughput / static.output_throughput:.2f}x")  # fmt: skip
print(f"P99 end-to-end latency, continuous / static: "
      f"{continuous.e2e_latency.p99 / static.e2e_latency.p99:.2f}x")  # fmt: skip
print(
    f"padding waste: static {static.padding_waste:.0%}, continuous {continuous.padding_waste:.0%}"
)
print(f"KV utilisation: static {static.kv_utilization:.0%}, "
      f"continuous {continuous.kv_utilization:.0%}")  # fmt: skip
assert static.padding_waste > 0 and continuous.padding_waste == 0
assert static.kv_utilization < continuous.kv_utilization

# %% [markdown]
# ## The timeline
#
# One row per request, time on the x-axis. Grey: queued; orange: prefill; blue: decode;
# red: padding (a finished request still occupying its slot). In the static panel, whole
# batches start and end together, and short requests wait behind long ones. In the
# continuous panel, a request starts as soon as a slot frees up.

# %% tags=["figure-timeline"]
out_dir = Path(tempfile.mkdtemp())
display(Image(filename=plots.plot_timeline(runs, out_dir / "timeline.png")))

# %% [markdown]
# Sequences per step and KV blocks over time. The static policy reserves whole
# `max_model_len` regions; the dotted lines show the blocks that hold real tokens.

# %% tags=["figure-batch-kv"]
display(Image(filename=plots.plot_batch_and_kv(runs, out_dir / "batch_kv.png")))

# %% [markdown]
# And the latency distributions: the fraction of requests that got their first token, or
# finished, within a given time.

# %%
display(Image(filename=plots.plot_latency_cdfs(runs, out_dir / "latency_cdf.png")))

# %% [markdown]
# ## The same KV memory for both policies
#
# Above, both policies had plenty of KV memory and the same `max_num_seqs`, so the batch
# was the same size under both: what continuous batching saved was padding and waiting.
# A real server has a fixed amount of memory for the KV cache, and that is where paging
# matters. A static server must reserve `max_model_len` slots per request (here 256, what
# a server accepting requests of up to 256 tokens must reserve), so the pool holds only
# `num_kv_blocks // 16` requests at once; the paged cache gives each request blocks as its
# tokens arrive, so the same pool holds as many requests as their *real* lengths allow.
# To keep the page quick, the sweep uses the first 8 requests of the workload: three
# pools, each sized in static "regions" of 256 slots, both policies, `max_num_seqs` 8;
# each run reports the largest batch it reached.

# %%
region_blocks = 256 // 16  # blocks one static request reserves
sweep = Workload(workload.name, workload.requests[:8])
kv_rows = []
for regions in (2, 4, 8):
    for policy in ("static", "continuous"):
        config = EngineConfig(
            scheduling_policy=policy,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=256,
            num_kv_blocks=regions * region_blocks,
            enable_prefix_caching=False,
        )
        s = run_engine(config, sweep, progress=False).summary
        kv_rows.append((regions, policy, s))
        print(f"{regions * region_blocks:4d} blocks ({regions:2d} regions) {policy:>10}: "
              f"{s.output_throughput:5.1f} output tok/s, E2E P99 {s.e2e_latency.p99:5.1f} s, "
              f"largest batch {s.max_batch_size:2d}, preemptions {s.num_preemptions}")  # fmt: skip

# %% tags=["figure-kv-budget"]
import matplotlib.pyplot as plt  # noqa: E402

fig, (tput, tail) = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
for policy, colour in (("static", "#e15759"), ("continuous", "#4e79a7")):
    rows = [(r * region_blocks, s) for r, p, s in kv_rows if p == policy]
    blocks = [b for b, _ in rows]
    tput.plot(blocks, [s.output_throughput for _, s in rows], "o-", color=colour, label=policy)
    tail.plot(blocks, [s.e2e_latency.p99 for _, s in rows], "o-", color=colour, label=policy)
    for b, s in rows:  # the largest batch each run reached, next to its point
        tput.annotate(f"{s.max_batch_size}", (b, s.output_throughput), xytext=(4, 4),
                      textcoords="offset points", color=colour, fontsize=9)  # fmt: skip
tput.set_ylabel("output tokens/s (label: largest batch)")
tail.set_ylabel("end-to-end latency P99 (s)")
for ax in (tput, tail):
    ax.set_xlabel("KV cache (blocks of 16 slots)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, frameon=False)
fig.tight_layout()
plt.show()

# %% [markdown]
# With 2 regions, the static policy can run at most 2 requests at a time, however short
# they are; the paged cache admits as many as their real lengths fit (the labels say how
# many it reached). As the pool grows, the static batch grows with it; with 8 regions it
# runs all 8 requests as one batch, and what is left between the policies is the padding
# and waiting effect of the first table. Where the gap is widest, and by how much, is in
# the printout above: it was measured when this page was built.

# %% [markdown]
# **What to remember**
#
# - Static batching computes padding and holds finished requests' slots; continuous
#   batching re-forms the batch every step, so every computed row is real work.
# - The same useful work finishes sooner, and short requests no longer wait for long ones:
#   tail latency falls.
# - `minivllm bench --policy static,continuous --plot DIR` runs the same comparison from
#   the command line, on any workload size.
