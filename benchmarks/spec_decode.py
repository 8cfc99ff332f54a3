"""When n-gram speculative decoding pays inside the continuous batch, and when it stops.

    python benchmarks/spec_decode.py [--batch-sizes 1,4,16,64] [--max-tokens 48]
        [--num-speculative-tokens 3] [--json spec.json] [--plot spec.png] [--threads N]

Two seeded workloads of chat requests to SmolLM2-135M-Instruct, greedy:

- copy-heavy: "repeat / correct / reformat / quote this passage", over passages the model
  itself wrote first (one paragraph per topic), so the answer reuses spans of the prompt;
- no-copy: "write a poem / give tips / explain / list facts about <topic>": answers that
  do not quote their prompt.

Each workload runs at every ``max_num_seqs`` in ``--batch-sizes``, with ``max(4, B)``
requests all arriving at t = 0, once without and once with
``speculative_config={"method": "ngram", ...}``, alternating, on one machine in one
process. It prints output tokens/s over the whole run and over the decode-only steps
(the steps with no prefill chunk: the regime speculation acts on), mean TPOT, the
acceptance metrics (vLLM's names), the median time of a decode-only step and its token
rows (the step-time curve that decides the crossover), and checks that the greedy
outputs are identical token for token.
Compare ratios within one run: on a shared machine absolute numbers move with the load.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.chat import chat_prompt

TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the moon", "bicycles", "rainforests",
    "chess", "bread baking", "lighthouses", "glaciers", "owls", "the printing press",
    "coral reefs", "trains", "deserts", "comets",
]  # fmt: skip
COPY_TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Correct any spelling or grammar mistakes in this passage and write it out in full:"
    "\n\n{passage}",
    "Reformat this passage as a bulleted list, one sentence per bullet, keeping the "
    "wording:\n\n{passage}",
    'Copy this passage and put it in quotation marks:\n\n"{passage}"',
]
NO_COPY_TASKS = [
    "Write a short poem about {topic}.",
    "Give three practical tips about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "List five surprising facts about {topic}.",
]


@dataclass
class Run:
    workload: str
    max_num_seqs: int
    speculative: bool
    num_requests: int
    num_output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    mean_tpot_ms: float
    decode_step_ms: float  # median duration of steps with no prefill
    decode_step_rows: float  # median token rows of those steps
    decode_tokens_per_s: float  # output tokens of steps with no prefill / their time
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    acceptance_rate_per_pos: list[float] | None = None
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


def make_engine(args, max_num_seqs: int, speculative: bool) -> LLMEngine:
    spec = None
    if speculative:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    return LLMEngine(
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative_config=spec,
            seed=0,
            enable_prefix_caching=False,  # the prompts are run more than once
        )
    )


def generate(engine: LLMEngine, prompts: list[dict], max_tokens: int, emitted=None) -> dict:
    """Run ``prompts`` to completion; the finished outputs by request id. ``emitted``, if
    a list, gets the number of output tokens each step produced."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, lengths = {}, {}
    while engine.has_unfinished_requests():
        num_new = 0
        for out in engine.step():
            num_tokens = len(out.outputs[0].token_ids)
            num_new += num_tokens - lengths.get(out.request_id, 0)
            lengths[out.request_id] = num_tokens
            if out.finished:
                outputs[out.request_id] = out
        if emitted is not None:
            emitted.append(num_new)
    return outputs


def make_workloads(engine: LLMEngine, args) -> dict[str, list[dict]]:
    """The passages first (the model writes one per topic), then both prompt sets."""
    tokenizer = engine.get_tokenizer()
    ask = lambda text: chat_prompt(tokenizer, [{"role": "user", "content": text}])
    paragraph_prompts = [ask(f"Write a short paragraph about {t}.") for t in TOPICS]
    written = generate(engine, paragraph_prompts, args.passage_tokens)
    passages = [written[str(i)].outputs[0].text.strip() for i in range(len(TOPICS))]
    copy = [ask(task.format(passage=p)) for task in COPY_TASKS for p in passages]
    no_copy = [ask(task.format(topic=t)) for task in NO_COPY_TASKS for t in TOPICS]
    return {"copy-heavy": copy, "no-copy": no_copy}


def measure(args, workload: str, prompts: list[dict], max_num_seqs: int, speculative: bool):
    engine = make_engine(args, max_num_seqs, speculative)
    generate(engine, prompts[:2], 4)  # warm-up: one-time costs are not billed to the run
    spec_before = copy.deepcopy(engine.spec_decoding_stats)
    engine.record_steps()
    num_requests = max(4, max_num_seqs)
    start = time.perf_counter()
    emitted: list[int] = []
    outputs = generate(engine, prompts[:num_requests], args.max_tokens, emitted)
    duration = time.perf_counter() - start
    tokens = {rid: out.outputs[0].token_ids for rid, out in outputs.items()}
    num_output = sum(len(t) for t in tokens.values())
    tpots = [o.metrics.tpot for o in outputs.values() if o.metrics.tpot is not None]
    steps = engine.take_step_stats()
    decode_only = [s.num_prefill_tokens == 0 for s in steps]
    decode_steps = [s for s, d in zip(steps, decode_only) if d]
    decode_time = sum(s.end_time - s.start_time for s in decode_steps)
    decode_tokens = sum(n for n, d in zip(emitted, decode_only) if d)
    run = Run(
        workload, max_num_seqs, speculative, num_requests, num_output, duration,
        num_output / duration, 1000 * statistics.mean(tpots),
        1000 * statistics.median(s.end_time - s.start_time for s in decode_steps),
        statistics.median(s.num_decode_tokens for s in decode_steps),
        decode_tokens / decode_time,
    )  # fmt: skip
    if speculative:
        spec = engine.spec_decoding_stats - spec_before
        run.num_drafts, run.num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        run.num_accepted_tokens = spec.num_accepted_tokens
        run.acceptance_rate = spec.acceptance_rate
        run.mean_acceptance_length = spec.mean_acceptance_length
        run.acceptance_rate_per_pos = spec.acceptance_rate_per_pos
    return run, tokens


def print_table(runs: list[Run], identical: dict) -> None:
    header = ("workload", "B", "spec", "out tok/s", "speedup", "decode tok/s", "speedup",
              "TPOT ms", "step ms", "step rows", "accept", "mean len",
              "greedy identical")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    base = {(r.workload, r.max_num_seqs): r for r in runs if not r.speculative}
    for r in runs:
        ref = base[(r.workload, r.max_num_seqs)]
        speedup = r.output_tokens_per_s / ref.output_tokens_per_s
        decode_speedup = r.decode_tokens_per_s / ref.decode_tokens_per_s
        cells = (
            r.workload, str(r.max_num_seqs), "ngram" if r.speculative else "off",
            f"{r.output_tokens_per_s:.1f}", f"{speedup:.2f}x",
            f"{r.decode_tokens_per_s:.1f}", f"{decode_speedup:.2f}x", f"{r.mean_tpot_ms:.0f}",
            f"{r.decode_step_ms:.0f}", f"{r.decode_step_rows:.0f}",
            f"{r.acceptance_rate:.0%}" if r.speculative else "",
            f"{r.mean_acceptance_length:.2f}" if r.speculative else "",
            identical.get((r.workload, r.max_num_seqs), "") if r.speculative else "",
        )  # fmt: skip
        print(" | ".join(cells))


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4))
    for workload, color in (("copy-heavy", "tab:blue"), ("no-copy", "tab:orange")):
        for spec, style in ((False, "--"), (True, "-")):
            rs = [r for r in runs if r.workload == workload and r.speculative == spec]
            ax_tps.plot([r.max_num_seqs for r in rs], [r.output_tokens_per_s for r in rs],
                        style, marker="o", color=color,
                        label=f"{workload}, {'ngram' if spec else 'no spec'}")  # fmt: skip
        off = {r.max_num_seqs: r for r in runs if r.workload == workload and not r.speculative}
        on = [r for r in runs if r.workload == workload and r.speculative]
        ax_ratio.plot(
            [r.max_num_seqs for r in on],
            [r.output_tokens_per_s / off[r.max_num_seqs].output_tokens_per_s for r in on],
            marker="o",
            color=color,
            label=f"{workload}, run",
        )
        ax_ratio.plot([r.max_num_seqs for r in on],
                      [r.decode_tokens_per_s / off[r.max_num_seqs].decode_tokens_per_s
                       for r in on], "--", marker="s", color=color,
                      label=f"{workload}, decode steps")  # fmt: skip
    for ax in (ax_tps, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_seqs")
        ax.legend()
    ax_tps.set_ylabel("output tokens/s")
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_ylabel("speedup with n-gram drafts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--workloads", default="copy-heavy,no-copy")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--passage-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads = make_workloads(make_engine(args, 16, False), args)
    runs, identical = [], {}
    for name in args.workloads.split(","):
        for b in batch_sizes:
            plain, plain_tokens = measure(args, name, workloads[name], b, speculative=False)
            spec, spec_tokens = measure(args, name, workloads[name], b, speculative=True)
            same = sum(plain_tokens[r] == spec_tokens[r] for r in plain_tokens)
            identical[(name, b)] = f"{same}/{len(plain_tokens)}"
            runs += [plain, spec]
            print(f"{name} B={b}: {plain.output_tokens_per_s:.1f} -> "
                  f"{spec.output_tokens_per_s:.1f} tok/s, accept {spec.acceptance_rate:.0%}",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(f"\nSmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} torch threads, "
          f"k={args.num_speculative_tokens}, lookup {args.prompt_lookup_min}-"
          f"{args.prompt_lookup_max}, {args.max_tokens} max output tokens, greedy\n")  # fmt: skip
    print_table(runs, identical)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) for r in runs],
                       "identical": {f"{w} B={b}": v for (w, b), v in identical.items()}},
                      f, indent=1)  # fmt: skip
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
