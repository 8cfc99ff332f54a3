"""Decode speed per weight format: tokens/s, bytes per token, and the bandwidth roofline.

For each format (fp32, ``int8``, ``gguf``) and each batch size: ``B`` sequences of a
64-token prompt (random token ids, fixed seed) generate 128 tokens greedily, EOS ignored,
all in one batch. The decode rate is the extra time of the full run over a prefill-only
run (``max_tokens=1``): ``B * 127`` tokens in that difference, best of ``--repeats``.

Bytes per token: the weights a decode step reads (`arithmetic.weight_bytes`, the format's
bytes per weight; the LM head included), shared by the ``B`` sequences of the step, plus
each sequence's KV cache read at its mean context. The roofline is the memory bandwidth
measured here (`hardware_probe.measure_read_bandwidth`) divided by those bytes: what the
step could reach if it did nothing but read them. CPU seconds per token
(``time.process_time``) are printed too: on a shared machine they move less than wall time.

    OMP_NUM_THREADS=1 python benchmarks/quantization.py                 # 1 and 32 sequences
    python benchmarks/quantization.py --formats none,int8 --batch 1 --max-tokens 32
    python benchmarks/quantization.py --rss     # peak resident memory per format

``--rss``: each format in a fresh process (load, four tokens), and a process that only
imports what the engine imports; the formats in turn, median of ``--rss-repeats`` rounds.

Before/after a change to the engine: run it from both checkouts one after the other
(``PYTHONPATH=<old worktree>``) and compare within one sitting.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.hardware_probe import measure_read_bandwidth
from minivllm.models import arithmetic


def run(llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[float, float, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu, outputs


def measure(quantization, batch: int, prompt_len: int, max_tokens: int, repeats: int) -> dict:
    llm = LLM(quantization=quantization, num_kv_blocks=batch * 20 + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(512, batch * prompt_len))  # fmt: skip
    config = llm.llm_engine.model_config
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, config.vocab_size) for _ in range(prompt_len)]}
        for _ in range(batch)
    ]
    run(llm, prompts[:1], 2)  # warm-up: numba compiles, oneDNN/FBGEMM pack
    best = None
    for _ in range(repeats):
        prefill_wall, prefill_cpu, _ = run(llm, prompts, 1)
        full_wall, full_cpu, outputs = run(llm, prompts, max_tokens)
        tokens = batch * (max_tokens - 1)
        result = {
            "decode_tok_s": tokens / (full_wall - prefill_wall),
            "cpu_ms_per_step": 1e3 * (full_cpu - prefill_cpu) / (max_tokens - 1),
            "prefill_tok_s": batch * prompt_len / prefill_wall,
            "first_output": outputs[0].outputs[0].token_ids,
        }
        if best is None or result["decode_tok_s"] > best["decode_tok_s"]:
            best = result
    llm.close()
    mean_context = prompt_len + max_tokens / 2
    weights = arithmetic.weight_bytes(config, 4, quantization=quantization)
    kv = mean_context * arithmetic.kv_bytes_per_token(config, 4)
    best["bytes_per_token"] = weights / batch + kv
    return best


RSS_SCRIPT = """
import resource, sys
import gguf, numba, torch, transformers
from minivllm import LLM, SamplingParams
if sys.argv[1] != "imports":
    quantization = None if sys.argv[1] == "none" else sys.argv[1]
    llm = LLM(quantization=quantization, num_kv_blocks=64, num_threads=1)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_mb(name: str) -> float:
    """Peak resident memory of a fresh process that imports torch, transformers, numba,
    gguf and minivllm, then (unless ``name`` is "imports") loads the model in this format
    and generates four tokens (``ru_maxrss``, KiB on Linux)."""
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, name], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[-1]) / 1024


def print_rss_table(names: list[str], repeats: int) -> None:
    """Median peak RSS per format over ``repeats`` rounds (the formats in turn within a
    round), the same above the imports' own peak, and each as a share of fp32's."""
    runs: dict[str, list[float]] = {name: [] for name in ["imports", *names]}
    for _ in range(repeats):
        for name in runs:
            runs[name].append(peak_rss_mb(name))
    peak = {name: statistics.median(values) for name, values in runs.items()}
    base = peak.pop("imports")
    print(f"imports alone (torch, transformers, numba, gguf, minivllm): {base:.0f} MB peak; "
          f"median of {repeats}")  # fmt: skip
    print("| format | peak RSS MB | % of fp32 | above imports MB | % of fp32's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    fp32 = peak.get("none")
    for name, mb in peak.items():
        share = f"{100 * mb / fp32:.0f} %" if fp32 else "-"
        above = f"{100 * (mb - base) / (fp32 - base):.0f} %" if fp32 else "-"
        label = "fp32" if name == "none" else name
        print(f"| {label} | {mb:.0f} | {share} | {mb - base:.0f} | {above} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="none,int8,gguf", help="comma list; none = fp32")
    parser.add_argument("--batch", default="1,32", help="comma list of batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rss", action="store_true", help="only the peak memory per format")
    parser.add_argument("--rss-repeats", type=int, default=3, help="rounds of --rss")
    args = parser.parse_args()
    if args.rss:
        print_rss_table(args.formats.split(","), args.rss_repeats)
        return
    torch.set_num_threads(args.threads)
    bandwidth = measure_read_bandwidth()
    print(
        f"memory read bandwidth measured now: {bandwidth / 1e9:.1f} GB/s; {args.threads} "
        f"thread(s); prompt {args.prompt_len}, {args.max_tokens} tokens"
    )
    print("| format | seqs | decode tok/s | CPU ms/step | prefill tok/s | MB/token | "
          "roofline tok/s | % of roofline | same tokens as fp32 |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    reference = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        for name in args.formats.split(","):
            quantization = None if name == "none" else name
            r = measure(quantization, batch, args.prompt_len, args.max_tokens, args.repeats)
            roofline = bandwidth / r["bytes_per_token"]
            reference.setdefault(batch, r["first_output"])
            same = r["first_output"] == reference[batch]
            print(
                f"| {name if quantization else 'fp32'} | {batch} | {r['decode_tok_s']:.1f} | "
                f"{r['cpu_ms_per_step']:.1f} | {r['prefill_tok_s']:.0f} | "
                f"{r['bytes_per_token'] / 1e6:.1f} | {roofline:.0f} | "
                f"{100 * r['decode_tok_s'] / roofline:.0f} % | {'yes' if same else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
