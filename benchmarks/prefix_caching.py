"""What prefix caching buys on a shared system prompt: prefill saved, hit rate, speed.

    python benchmarks/prefix_caching.py [--num-requests 8] [--system-prompt-len 256]
        [--user-len 32] [--output-len 16] [--max-num-batched-tokens 256] [--repeats 2]

Every request is the same ``--system-prompt-len``-token system prompt followed by its own
``--user-len`` tokens, and generates exactly ``--output-len`` tokens (greedy, EOS ignored).
All requests arrive at once: a block is registered when the step that computes it is
scheduled, so requests admitted after the first one share the blocks it computes, in
that step or a later one (see kv_cache_manager.py). The same workload runs with prefix
caching off and on (alternating, ``--repeats`` times each, best time kept), on
SmolLM2-135M-Instruct, and the
script prints the tokens the model had to compute, the prefix-cache hit rate from
`LLMEngine.stats()`, wall time and throughput, and checks the outputs are identical.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from minivllm import LLMEngine, SamplingParams
from minivllm.entrypoints import cli_args


@dataclass
class RunResult:
    seconds: float
    num_computed_tokens: int  # tokens the model ran on (prompts minus hits, plus decodes)
    num_output_tokens: int
    hit_rate: float
    outputs: dict[str, list[int]]


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]  # skip special ids
    system = draw(args.system_prompt_len)
    return [system + draw(args.user_len) for _ in range(args.num_requests)]


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> RunResult:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = engine.stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs, num_computed = {}, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        num_computed += engine.last_step.total_num_scheduled_tokens
    seconds = time.perf_counter() - start
    after = engine.stats()
    queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    hit_rate = hits / queried if queried else 0.0
    num_outputs = sum(len(tokens) for tokens in outputs.values())
    return RunResult(seconds, num_computed, num_outputs, hit_rate, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    cli_args.add_engine_args(parser, exclude=("enable_prefix_caching", "max_num_seqs"))
    parser.set_defaults(max_num_batched_tokens=256)
    args = parser.parse_args()

    engines = {}
    for caching in (False, True):
        config = cli_args.engine_config_from_args(
            args, max_num_seqs=args.num_requests, enable_prefix_caching=caching
        )
        engines[caching] = LLMEngine(config)
    engine = engines[False]
    prompts = make_prompts(args, engine.model_config.vocab_size)
    print(
        f"{args.num_requests} requests: {args.system_prompt_len}-token shared system prompt "
        f"+ {args.user_len} own tokens, {args.output_len} output tokens each; "
        f"{engine.config.torch_device}, {engine.config.torch_dtype}, block_size "
        f"{args.block_size}, max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    warmup = [[7] * 8]  # shares nothing with the workload, so leaves nothing to hit
    for caching_engine in engines.values():
        run(caching_engine, warmup, 4)

    best: dict[bool, RunResult] = {}
    for _ in range(args.repeats):
        for caching, caching_engine in engines.items():
            assert caching_engine.reset_prefix_cache()  # each repeat starts cold
            result = run(caching_engine, prompts, args.output_len)
            if caching not in best or result.seconds < best[caching].seconds:
                best[caching] = result

    off, on = best[False], best[True]
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"{'prefix caching':>16} {'computed tokens':>16} {'hit rate':>9} {'seconds':>8} "
          f"{'output tok/s':>13} {'total tok/s':>12}")  # fmt: skip
    for name, r in (("off", off), ("on", on)):
        total_tokens = prompt_tokens + r.num_output_tokens
        print(
            f"{name:>16} {r.num_computed_tokens:>16} {r.hit_rate:>9.1%} {r.seconds:>8.2f} "
            f"{r.num_output_tokens / r.seconds:>13.1f} {total_tokens / r.seconds:>12.1f}"
        )
    saved = off.num_computed_tokens - on.num_computed_tokens
    print(
        f"prefill tokens saved: {saved} of {prompt_tokens} prompt tokens "
        f"({saved / prompt_tokens:.1%}); speed-up {off.seconds / on.seconds:.2f}x; "
        f"outputs identical: {on.outputs == off.outputs}"
    )


if __name__ == "__main__":
    main()
