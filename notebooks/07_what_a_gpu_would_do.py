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
# # 7. What a GPU would do
#
# Notebook 3 measured static against continuous batching on this CPU, where every token
# row costs its matmul FLOPs. The published gains of continuous batching and
# PagedAttention come from accelerators, where a decode step is bound by *reading* the
# weights and the KV cache, and where KV memory, not compute, caps how many requests run
# at once. No GPU is needed to see that: `minivllm.simulator` runs minivllm's real
# schedulers, KV-cache manager and prefix cache behind the engine's executor seam, and
# replaces only the model step with a roofline cost model of a device
# (`minivllm/simulator/cost_model.py`). Time is simulated: every number below is in
# *simulated* seconds of an H200 (spec-sheet figures, see the
# [chapter](../tutorial/what-a-gpu-would-do.md) for sources and assumptions).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from minivllm.config import EngineConfig
from minivllm.models.arithmetic import num_parameters
from minivllm.simulator.cluster import Deployment, search_replicas, simulate
from minivllm.simulator.cost_model import ChunkShape, step_cost
from minivllm.simulator.hardware import get_hardware
from minivllm.simulator.memory import size_kv_pool
from minivllm.simulator.models import get_model
from minivllm.simulator.workloads import chat_workload

notebook_start = time.perf_counter()
h200, llama = get_hardware("h200"), get_model("llama-3.1-8b")
print(h200)
print(f"llama-3.1-8b: {num_parameters(llama) / 1e9:.2f} B parameters")

# %% [markdown]
# ## One decode step: memory-bound
#
# A decode step of ``B`` requests, each with ``c`` tokens of context, reads all 16 GB of
# weights once (shared by the whole batch) and each request's KV (128 KiB per token for
# Llama-3.1-8B in BF16). Its FLOPs are ``2 x parameters`` per row. The cost model takes
# the larger of the two times:

# %% tags=["figure-sim-decode-roofline"]
batch_sizes = [1, 8, 32, 64, 128, 256, 512]
fig, ax = plt.subplots(figsize=(7, 4))
for context in (512, 2048):
    times = [
        step_cost(llama, h200, [ChunkShape(1, context, True)] * b).seconds for b in batch_sizes
    ]
    ax.plot(batch_sizes, [1e3 * t for t in times], marker="o", label=f"context {context}")
    for b, t in zip(batch_sizes, times):
        cost = step_cost(llama, h200, [ChunkShape(1, context, True)] * b)
        print(
            f"context {context:>5}, batch {b:>3}: {1e3 * t:6.2f} ms per step, "
            f"{b / t:7.0f} tokens/s, {cost.bound}-bound"
        )
ax.set_xlabel("decode batch size")
ax.set_ylabel("simulated step time (ms)")
ax.set_title("Llama-3.1-8B decode step on an H200 (roofline)")
ax.legend()
plt.show()

# %% [markdown]
# Up to a few hundred requests, a bigger batch costs little more per step: padding rows
# and idle slots are nearly free, and throughput grows with the batch. That is why, on a
# GPU, what limits throughput is how many requests fit in the KV cache at once.
#
# ## How many requests fit: paged vs contiguous KV
#
# The KV pool is sized the way vLLM does (`minivllm/simulator/memory.py`): 90 % of the
# device's memory, minus the weights, minus the activations of the largest step. A
# paged cache (the continuous policy) stores each request's actual tokens; a contiguous
# cache (the static policy, as servers did before PagedAttention) reserves
# `max_model_len` per request up front.

# %%
pool = size_kv_pool(llama, h200, max_num_batched_tokens=8192, max_num_seqs=256)
kv_tokens = pool.num_blocks * 16
print(
    f"KV pool: {pool.num_blocks} blocks of 16 tokens = {kv_tokens} tokens "
    f"({pool.kv_bytes / 2**30:.1f} GiB; weights {pool.weights / 2**30:.1f} GiB, "
    f"activations {pool.activations / 2**30:.1f} GiB)"
)
sharegpt = chat_workload(2000, "sharegpt", seed=0)
mean_len = np.mean([len(r.prompt_token_ids) + r.max_tokens for r in sharegpt.requests])
print(f"ShareGPT-like requests hold {mean_len:.0f} tokens on average when they finish")
print(f"paged: about {kv_tokens / mean_len:.0f} finished requests' worth of KV at once")
for max_model_len in (2048, 4096, 8192, 32768, 131072):
    regions = pool.num_blocks // (max_model_len // 16)
    print(f"contiguous, max_model_len {max_model_len:>6}: {regions:>4} requests at once")

# %% [markdown]
# ## Static vs continuous, across load and lengths
#
# Poisson arrivals at several request rates, two length distributions: ShareGPT-like
# (lognormal, long tail, means about 161 prompt / 338 output tokens) and Alpaca-like
# (short: about 19 / 58). vLLM's defaults for a GPU server: `max_num_seqs=256`,
# `max_num_batched_tokens=8192`. The static policy reserves the workload's longest
# request per slot (a well-tuned static server; less generous ones reserve the model's
# whole context).

# %%
config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
deployment = Deployment(llama, h200)
rows = []
for lengths, num_requests, rates in (
    ("sharegpt", 250, (5, 20, 80)),
    ("alpaca", 500, (20, 80, 320)),
):
    for rate in rates:
        workload = chat_workload(num_requests, lengths, request_rate=rate, seed=1)
        max_model_len = workload.max_request_len
        runs = {
            policy: simulate(
                EngineConfig(
                    max_num_seqs=256,
                    max_num_batched_tokens=8192,
                    max_model_len=max_model_len,
                    scheduling_policy=policy,
                ),
                deployment,
                workload,
                record_steps=False,
            ).summary
            for policy in ("static", "continuous")
        }
        s, c = runs["static"], runs["continuous"]
        rows.append((lengths, rate, s, c))
        print(
            f"{lengths:>8} {rate:>4} req/s | output tok/s static {s.output_throughput:7.0f} "
            f"continuous {c.output_throughput:7.0f} "
            f"({c.output_throughput / s.output_throughput:4.2f}x) | "
            f"P99 TTFT {s.ttft.p99:6.2f} -> {c.ttft.p99:5.2f} s | "
            f"P99 e2e {s.e2e_latency.p99:6.1f} -> {c.e2e_latency.p99:5.1f} s "
            f"({c.e2e_latency.p99 / s.e2e_latency.p99 - 1:+.0%})"
        )

# %% [markdown]
# At a low rate both policies keep up with the traffic: throughput is the arrival rate
# under either, and the difference is latency only. As the rate grows, the static server
# saturates first: its batches wait for their longest member, its slots are capped by
# contiguous regions, and a request arriving mid-batch waits for the whole batch.
#
# ## Capacity planning: how many H200s for this traffic?
#
# A serving engineer's question: at 150 ShareGPT-like requests/s, how many replicas of
# one H200 each keep P99 TTFT under half a second? `search_replicas` doubles the replica
# count until the target is met, then bisects; a least-loaded router spreads the
# requests. (`minivllm simulate --search-p99-ttft 0.5 --request-rate 150 ...` does the
# same from the command line.)

# %%
workload = chat_workload(600, "sharegpt", request_rate=150, seed=2)
planning = Deployment(llama, h200, router="least-loaded")
continuous_config = EngineConfig(
    max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=workload.max_request_len
)
found = search_replicas(continuous_config, planning, workload, p99_ttft_target=0.5)
tried = ", ".join(f"{n}: {p99:.2f} s" for n, p99 in found.tried.items())
print(f"continuous: {found.num_replicas} replicas (P99 TTFT by replica count: {tried})")

# %% [markdown]
# The static policy on twice as many replicas, for comparison: its P99 TTFT is bound by
# how long a batch runs (its longest request), not by how many replicas share the load.

# %%
static_config = EngineConfig(
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=workload.max_request_len,
    scheduling_policy="static",
)
doubled = Deployment(llama, h200, router="least-loaded", num_replicas=2 * found.num_replicas)
static = simulate(static_config, doubled, workload, record_steps=False).summary
print(f"static on {doubled.num_replicas} replicas: P99 TTFT {static.ttft.p99:.1f} s")

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s of real time")
