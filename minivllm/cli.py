"""The ``minivllm`` command: ``minivllm generate ...`` (and ``minivllm bench ...``)."""

from __future__ import annotations

import argparse
import sys


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine (`EngineConfig` fields)."""
    from minivllm.attention import available_backends

    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF checkpoint (default: bundled SmolLM2)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", *available_backends()],
        help="auto: numba-cpu on CPU when numba is installed, else torch (the reference)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument(
        "--policy",
        default="continuous",
        help="scheduling policy: continuous or static (bench: a comma-separated list)",
    )


def engine_config_from_args(args: argparse.Namespace):
    from minivllm.config import EngineConfig

    return EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.policy,
    )


def _generate(args: argparse.Namespace) -> int:
    from minivllm import LLMEngine, RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )
    engine = LLMEngine(engine_config_from_args(args))
    tokenizer = engine.tokenizer
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            prompt = {"prompt": prompt, "prompt_token_ids": tokenizer(prompt).input_ids}
        engine.add_request(str(i), prompt, params)

    # All prompts run together as one continuous batch; text streams in as it is made.
    texts = {str(i): "" for i in range(len(args.prompts))}
    stream = len(args.prompts) == 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].text
            if stream:
                print(out.outputs[0].text, end="", flush=True)
            if out.finished and not stream:
                reason = out.outputs[0].finish_reason
                print(f"--- [{out.request_id}] {args.prompts[int(out.request_id)]!r} ({reason})")
                print(texts[out.request_id].strip(), flush=True)
    if stream:
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm", description="vLLM's engine core, small enough to read."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s); several run as one batch")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    add_engine_arguments(gen)
    gen.set_defaults(func=_generate)

    from minivllm.bench.command import add_bench_arguments, run_bench

    bench = sub.add_parser("bench", help="measure static vs continuous batching on one workload")
    add_bench_arguments(bench)
    add_engine_arguments(bench)
    bench.set_defaults(func=run_bench, policy="static,continuous")  # the comparison
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, not a traceback
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
