"""minivllm against transformers on SmolLM2: output throughput and latencies.

    python benchmarks/throughput.py [any `minivllm bench` option, e.g. --threads 1]

A seeded heterogeneous offline workload (32 requests, prompts 16-400 tokens, outputs
8-128 tokens, exact lengths), run by minivllm's continuous batching and by transformers'
`generate` on left-padded static batches of the same size (plus its own continuous
batching, `generate_batch`). Prints output tokens/s and latency percentiles side by side.
A thin wrapper: it is ``minivllm bench --policy continuous --compare-hf`` with these
defaults; options given on the command line come after them and win.
"""

from __future__ import annotations

import sys

from minivllm.cli import main

DEFAULTS = [
    "bench",
    "--policy", "continuous",
    "--compare-hf",
    "--num-prompts", "32",
    "--prompt-len", "uniform:16:400",
    "--output-len", "uniform:8:128",
    "--max-num-seqs", "32",
]  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
