"""The ``minivllm`` command: ``minivllm generate ...`` (and ``minivllm bench ...``,
``minivllm simulate ...``, ``minivllm serve ...``)."""

from __future__ import annotations

import argparse
import sys

from minivllm.entrypoints import cli_args


def _generate(args: argparse.Namespace) -> int:
    import torch

    from minivllm import LLMEngine, RequestOutputKind, SamplingParams
    from minivllm.chat import chat_prompt

    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
    engine = LLMEngine(cli_args.engine_config_from_args(args))
    from minivllm.quantization import weights_line

    print(weights_line(engine.config.quantization, engine.model_config), file=sys.stderr)
    tokenizer = engine.get_tokenizer()
    # An instruct model answers a question only inside its chat template; without it,
    # SmolLM2 continues the text ("The answer is:") and stops.
    has_template = tokenizer is not None and tokenizer.chat_template is not None
    use_chat = has_template if args.chat is None else args.chat
    for i, prompt in enumerate(args.prompts):
        if use_chat:
            prompt = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
        engine.add_request(str(i), prompt, params)

    # All prompts run together as one continuous batch; text streams in as it is made.
    texts = {str(i): "" for i in range(len(args.prompts))}
    stream = len(args.prompts) == 1
    if not stream:
        print("(the prompts run as one batch; each answer prints when it finishes)")
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].text
            if stream:
                print(out.outputs[0].text, end="", flush=True)
            if out.finished and not stream:
                print(f"--- [{out.request_id}] {args.prompts[int(out.request_id)]!r}")
                print(texts[out.request_id].strip(), flush=True)
            if out.finished:
                _print_cut_note(out.outputs[0].finish_reason, args.max_tokens, stream)
    if engine.spec_decoding_stats is not None:
        print(engine.spec_decoding_stats.log_line())
    return 0


def _print_cut_note(finish_reason, max_tokens: int, stream: bool) -> None:
    """Say when an answer stopped because it hit --max-tokens, not because it was done."""
    if stream:
        print()
    if finish_reason == "length":  # max_tokens (or max_model_len) reached
        print(f"[cut at --max-tokens {max_tokens}; raise it for the rest]", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm", description="vLLM's engine core, small enough to read."
    )
    parser.add_argument("--version", action="version", version=f"minivllm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = {"formatter_class": cli_args.DefaultsHelpFormatter}

    gen = sub.add_parser("generate", help="generate text for one or more prompts", **formatter)
    gen.add_argument("prompts", nargs="+", help="prompt text(s); several run as one batch")
    # Types parse and refuse what no setting accepts; SamplingParams checks the ranges.
    gen.add_argument("--max-tokens", type=cli_args.positive_int, default=64)
    gen.add_argument(
        "--temperature", type=cli_args.finite_float, default=0.0, help="0 = greedy (default: 0.0)"
    )
    gen.add_argument("--top-p", type=cli_args.finite_float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=cli_args.finite_float, default=0.0)
    gen.add_argument(
        "--sampling-seed",
        type=cli_args.seed,
        default=None,
        help="per-request seed (default: drawn from the engine's --seed)",
    )
    gen.add_argument(
        "--stop",
        type=cli_args.non_empty_str,
        action="append",
        default=None,
        help="stop string, repeatable (default: none)",
    )
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the model's chat template (default: yes when the model "
        "has one, as SmolLM2-Instruct does); --no-chat sends the text as a raw completion",
    )
    gen.add_argument(
        "--threads",
        type=cli_args.positive_int,
        default=None,
        help="torch CPU threads (default: torch's, one per core). On a CPU shared with other "
        "busy processes, 1 is often much faster: threads wait on each other at every small op",
    )
    cli_args.add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from minivllm.bench.command import add_bench_arguments, run_bench

    bench = sub.add_parser(
        "bench", help="measure static vs continuous batching on one workload", **formatter
    )
    add_bench_arguments(bench)
    cli_args.add_engine_args(bench, exclude=("scheduling_policy",))  # --policy: a list
    bench.set_defaults(func=run_bench)

    from minivllm.simulator.command import add_simulate_arguments, run_simulate

    sim = sub.add_parser(
        "simulate",
        help="the real schedulers on simulated hardware (a roofline cost model)",
        **formatter,
    )
    add_simulate_arguments(sim)
    sim.set_defaults(func=run_simulate)

    from minivllm.entrypoints.openai.cli_args import add_server_arguments

    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (like `vllm serve`)", **formatter
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as in `vllm serve MODEL` (the same as --model; default: the bundled "
        "SmolLM2-135M-Instruct)",
    )
    add_server_arguments(serve)
    cli_args.add_engine_args(serve)
    serve.set_defaults(func=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:  # `minivllm serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"two models given: {args.model_tag!r} and --model {args.model!r}; give one"
            )
        args.model = args.model_tag
    config = cli_args.engine_config_from_args(args)  # bad options fail before the model loads
    try:
        from minivllm.entrypoints.openai.api_server import run_serve
    except ImportError as e:
        raise ValueError(f"{e}: minivllm serve needs the serve extra: {INSTALL_HINT}") from e
    return run_serve(args, config)


# In a clone (the usual case: minivllm is not on PyPI), extras install with -e ".[extra]".
INSTALL_HINT = 'pip install -e ".[serve]" in the minivllm clone'


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("minivllm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad flag: argparse has said why
        return e.code
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, not a traceback
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
