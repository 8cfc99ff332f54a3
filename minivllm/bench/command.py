"""``minivllm bench``: one workload through each scheduling policy (and, optionally,
transformers), then the side-by-side table, what it shows in plain words, JSON and plots."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict

from minivllm.bench import workloads
from minivllm.bench.workloads import Workload
from minivllm.config import SCHEDULING_POLICIES
from minivllm.entrypoints import cli_args


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--policy",
        "--scheduling-policy",
        default="static,continuous",
        type=cli_args.comma_list(SCHEDULING_POLICIES, "scheduling policy"),
        help="scheduling policies to compare, comma-separated: continuous, static",
    )
    w = bench.add_argument_group("workload")
    w.add_argument(
        "--workload", choices=["synthetic", "shared-prefix", "file"], default="synthetic"
    )
    w.add_argument("--num-prompts", type=cli_args.positive_int, default=64)
    w.add_argument(
        "--prompt-len",
        default="uniform:16:400",
        type=workloads.length_distribution,
        help="N, uniform:LO:HI or lognormal:MED:SIGMA:LO:HI",
    )
    w.add_argument(
        "--output-len",
        default="uniform:8:128",
        type=workloads.length_distribution,
        help="like --prompt-len",
    )
    w.add_argument(
        "--system-prompt-len",
        type=cli_args.positive_int,
        default=256,
        help="for --workload shared-prefix",
    )
    w.add_argument(
        "--dataset",
        type=cli_args.existing_file,
        default=None,
        help="JSONL of prompts, for --workload file",
    )
    w.add_argument("--workload-seed", type=cli_args.non_negative_int, default=0)
    r = bench.add_argument_group("arrivals (default: offline, everything at t=0)")
    r.add_argument(
        "--request-rate", type=cli_args.rate, default=math.inf, help="Poisson, requests/s"
    )
    r.add_argument(
        "--max-concurrency",
        type=cli_args.positive_int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    h = bench.add_argument_group("a running server instead (like `vllm bench serve`)")
    h.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="send the workload over HTTP to an OpenAI-compatible server (minivllm serve, "
        "vllm serve) at URL, e.g. http://127.0.0.1:8000; latencies are measured client-side "
        "from the stream. The engine options then only pick the tokenizer (--model)",
    )
    h.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` to ask for (default: the first one the server lists)",
    )
    o = bench.add_argument_group("output")
    o.add_argument("--compare-hf", action="store_true", help="add transformers baseline rows")
    o.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write timeline/batch/CDF PNGs")
    o.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    o.add_argument("--brief", action="store_true", help="a short table: the key rows only")
    o.add_argument(
        "--threads",
        type=cli_args.positive_int,
        default=None,
        help="torch CPU threads for every run (default: torch's). On a CPU shared with other "
        "busy processes, 1 avoids threads waiting on each other at every small op",
    )


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from minivllm.bench import report
    from minivllm.bench.hardware_probe import measure_matmul_peak
    from minivllm.bench.runner import run_engine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    policies = args.policy
    for policy in policies:
        _engine_config(args, policy)  # a bad option or policy name fails before any work
    model_path = _model_path(args.model)
    workload = build_workload(args, *_tokenizer_and_vocab_size(model_path))
    if args.base_url:
        return _run_over_http(args, workload, model_path)
    # Unless told otherwise, what a well-configured static server reserves per request:
    # room for the workload's longest request, not the model's whole context.
    max_model_len = args.max_model_len or workload.max_request_len
    configs = [_engine_config(args, policy, max_model_len) for policy in policies]
    print(workload.describe(), file=sys.stderr)
    _print_weights(configs[0], model_path)

    progress = not args.no_progress
    runs = [run_engine(config, workload, args.max_concurrency, progress) for config in configs]
    num_kv_blocks = runs[0].num_kv_blocks
    if args.compare_hf:
        runs += _hf_runs(args, configs[0], model_path, workload, num_kv_blocks, progress)

    _add_model_flops(runs, model_path)
    context = _context(args, configs[0], workload, max_model_len, num_kv_blocks)
    # Stated, not implied: prefix caching's default differs by policy (on where it can be).
    context["prefix_caching"] = {c.scheduling_policy: c.enable_prefix_caching for c in configs}
    states = [f"{p} {'on' if on else 'off'}" for p, on in context["prefix_caching"].items()]
    context["title"] += f"\nprefix caching: {', '.join(states)}"
    context["matmul_peak_gflops"] = measure_matmul_peak()
    notes = ["(percentiles: nearest rank, each one a latency some request or token really had)"]
    notes += report.conclusions(runs)
    peak = (
        f"\nfp32 matmul peak measured just now: {context['matmul_peak_gflops']:.0f} GFLOP/s "
        f"({_threads(torch.get_num_threads())})"
    )
    if not args.brief:  # the brief table has no GFLOP/s row to explain
        peak += "; the model GFLOP/s row counts useful work only (no padding, no recomputation)"
    notes.append(peak)
    agree = report.outputs_agree(runs, "static", "continuous")
    if agree:
        notes.append(
            f"\ngreedy outputs identical under both policies: {agree[0]}/{agree[1]} requests"
        )
    report.print_and_save(runs, context, args.json, args.plot, notes, brief=args.brief)
    return 0


def _run_over_http(args: argparse.Namespace, workload: Workload, model_path) -> int:
    """``--base-url``: the workload through a running server, timed from its streams."""
    from minivllm.bench import report
    from minivllm.bench.http_client import run_http

    print(workload.describe(), file=sys.stderr)
    run = run_http(
        args.base_url,
        workload,
        args.max_concurrency,
        progress=not args.no_progress,
        model=args.served_model_name,
        name="HTTP",
    )
    _add_model_flops([run], model_path)
    context = _context(args, None, workload, None, None)
    report.print_and_save([run], context, args.json, args.plot)
    return 0


def _print_weights(config, model_path) -> None:
    """The weights' format and bytes, before the runs (``--quantization``)."""
    from minivllm.models.loader import load_model_config
    from minivllm.quantization import weights_line

    model_config, _ = load_model_config(model_path)
    print(weights_line(config.quantization, model_config), file=sys.stderr)


def _add_model_flops(runs, model_path) -> None:
    """Each run's useful work, from the model's shape and the requests' lengths."""
    from minivllm.models.arithmetic import request_flops
    from minivllm.models.loader import load_hf_config, model_config_from_hf

    model_config = model_config_from_hf(load_hf_config(model_path))
    for run in runs:
        run.summary.model_flops = sum(
            request_flops(model_config, r.num_prompt_tokens, r.num_output_tokens)
            for r in run.requests
        )


def build_workload(args: argparse.Namespace, tokenizer, vocab_size: int) -> Workload:
    prompt_len, output_len = args.prompt_len, args.output_len
    # Random prompt ids skip the special tokens (they sit at the start of the vocabulary).
    special = getattr(tokenizer, "all_special_ids", None) or [-1]
    token_range = (max(special) + 1, vocab_size)
    n, seed = args.num_prompts, args.workload_seed
    if args.workload == "synthetic":
        workload = workloads.synthetic(n, prompt_len, output_len, token_range, seed)
    elif args.workload == "shared-prefix":
        workload = workloads.shared_system_prompt(
            n, args.system_prompt_len, prompt_len, output_len, token_range, seed
        )
    else:
        if args.dataset is None:
            raise ValueError("--workload file needs --dataset PATH")
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model has none")
        tokenize = lambda text: tokenizer(text).input_ids
        workload = workloads.from_jsonl(args.dataset, tokenize, output_len, seed, n)
    if math.isfinite(args.request_rate):
        workload = workload.with_poisson_arrivals(args.request_rate, seed)
    return workload


def _engine_config(args: argparse.Namespace, policy: str, max_model_len: int | None = None):
    overrides = {"scheduling_policy": policy}
    if max_model_len is not None:
        overrides["max_model_len"] = max_model_len
    return cli_args.engine_config_from_args(args, **overrides)


def _tokenizer_and_vocab_size(model_path):
    from minivllm.models.loader import load_hf_config, load_tokenizer

    # Without a tokenizer, token-id workloads still work.
    return load_tokenizer(model_path), load_hf_config(model_path).vocab_size


def _hf_runs(args, config, model_path, workload: Workload, num_kv_blocks, progress) -> list:
    from minivllm.bench import hf_baselines

    if math.isfinite(args.request_rate):
        print("(--compare-hf runs offline only; skipped with --request-rate)", file=sys.stderr)
        return []
    device, dtype = config.torch_device, config.torch_dtype
    model = hf_baselines.load_hf_model(model_path, dtype, device)
    static = hf_baselines.run_hf_static(model, workload, config.max_num_seqs, progress)
    model = hf_baselines.load_hf_model(model_path, dtype, device)  # CB may switch attention
    continuous = hf_baselines.run_hf_continuous(
        model,
        workload,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        num_kv_blocks * config.block_size,
        progress,
    )
    return [static, continuous]


def _threads(n: int) -> str:
    return "1 thread" if n == 1 else f"{n} threads"


def _model_path(model: str | None) -> str:
    from minivllm.models.model_files import resolve_model_path

    return str(resolve_model_path(model))


def _context(args, config, workload: Workload, max_model_len: int, num_kv_blocks: int) -> dict:
    mode = (
        "offline (all requests at t=0)"
        if not math.isfinite(args.request_rate)
        else f"online, Poisson {args.request_rate:g} req/s"
    )
    if args.max_concurrency:
        mode += f", max concurrency {args.max_concurrency}"
    import torch

    from minivllm.bench import report

    if config is None:  # --base-url: the server's configuration is its own
        title = f"server {args.base_url} over HTTP\n{workload.describe()} | {mode}"
        return {
            "title": title,
            "command": report.command_line(),
            "base_url": args.base_url,
            "workload": _workload_json(args, workload, mode),
        }
    model = config.model or "SmolLM2-135M-Instruct"
    title = (
        f"{model} | {config.torch_dtype} on {config.torch_device}, "
        f"{_threads(torch.get_num_threads())} | attention "
        f"{config.attention_backend_name} | max_num_seqs {config.max_num_seqs}, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, max_model_len "
        f"{max_model_len}, {num_kv_blocks} KV blocks x {config.block_size}\n"
        f"{workload.describe()} | {mode}"
    )
    engine_config = asdict(config) | {
        "max_model_len": max_model_len,
        "num_kv_blocks": num_kv_blocks,
    }
    engine_config.pop("scheduling_policy")
    return {
        "title": title,
        "command": report.command_line(),
        "engine_config": engine_config,
        "workload": _workload_json(args, workload, mode),
        "torch_threads": torch.get_num_threads(),
    }


def _workload_json(args, workload: Workload, mode: str) -> dict:
    return {
        "description": workload.describe(),
        "num_requests": len(workload.requests),
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "mode": mode,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,
        "max_concurrency": args.max_concurrency,
    }
