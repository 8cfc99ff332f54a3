"""The HTTP path's cost, and static vs continuous batching online, through a real server.

    python benchmarks/serving.py overhead [--threads 1] [--num-prompts 32] [--repeat 3]
    python benchmarks/serving.py policies [--threads 1] [--num-prompts 48] [--request-rate 4]

``overhead``: one seeded workload at 16 concurrent streams, first in process (the engine
driven directly, as ``minivllm bench`` does), then through ``minivllm serve`` on
127.0.0.1 with ``run_http`` as the client; prints both throughputs and the overhead, and
the server process's CPU use over 5 s while idle (read from /proc).

``policies``: the same Poisson workload through two servers, one per scheduling policy,
measured client-side; prints ``minivllm bench``'s table for the two runs.

Each server runs in its own process (so client and server do not share a GIL) and is
stopped before the next run starts.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from minivllm.bench import report
from minivllm.bench.http_client import run_http
from minivllm.bench.runner import run_engine
from minivllm.bench.workloads import LengthDistribution, synthetic
from minivllm.config import EngineConfig
from minivllm.models.loader import load_hf_config, load_tokenizer

ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 512}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["overhead", "policies"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", default="uniform:16:256")
    parser.add_argument("--output-len", default="uniform:16:64")
    parser.add_argument("--request-rate", type=float, default=4.0, help="for policies")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="for overhead: run pairs")
    args = parser.parse_args()
    model = args.model or _default_model()
    tokenizer, vocab_size = load_tokenizer(model), load_hf_config(model).vocab_size
    token_range = (max(tokenizer.all_special_ids) + 1, vocab_size)
    workload = synthetic(
        args.num_prompts,
        LengthDistribution.parse(args.prompt_len),
        LengthDistribution.parse(args.output_len),
        token_range,
        seed=0,
    )
    print(workload.describe(), file=sys.stderr)
    if args.what == "overhead":
        return _overhead(args, model, workload)
    return _policies(args, model, workload.with_poisson_arrivals(args.request_rate, seed=0))


def _overhead(args, model: str, workload) -> int:
    """In process and through HTTP, alternately ``--repeat`` times each (the server idles,
    using no CPU, while the in-process run goes), so slow drifts in machine load hit both."""
    import torch

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=model, **ENGINE)
    direct, http = [], []
    with _server(model, args.threads, "continuous") as (url, pid):
        idle_cpu = _cpu_share(pid, seconds=5.0)
        for _ in range(args.repeat):
            run = run_engine(config, workload, args.max_concurrency, progress=False)
            direct.append(run.summary.output_throughput)
            run = run_http(url, workload, args.max_concurrency, progress=False)
            http.append(run.summary.output_throughput)
    print(f"\n{workload.describe()}, {args.max_concurrency} concurrent streams")
    print("in process (engine driven directly), output tokens/s:", _list(direct))
    print("through HTTP (minivllm serve),       output tokens/s:", _list(http))
    ratios = [1 - h / d for d, h in zip(direct, http)]
    print("HTTP overhead per pair (1 - http / in process):", ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"HTTP overhead, total: {1 - sum(http) / sum(direct):+.1%}")
    print(f"idle server process CPU over 5 s: {idle_cpu:.2%} of one core")
    return 0


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _policies(args, model: str, workload) -> int:
    runs = []
    for policy in ("static", "continuous"):
        with _server(model, args.threads, policy) as (url, _):
            runs.append(run_http(url, workload, args.max_concurrency, progress=False, name=policy))
    mode = f"Poisson {args.request_rate:g} req/s, max concurrency {args.max_concurrency}"
    print(f"\n{workload.describe()} | online through HTTP, {mode}")
    print(report.format_table(runs))
    return 0


@contextmanager
def _server(model: str, threads: int, policy: str):
    """``minivllm serve`` in a child process on a free port; yields (url, pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "minivllm.entrypoints.openai.api_server"]
    command += ["--model", model, "--port", str(port), "--threads", str(threads)]
    command += ["--policy", policy, "--log-level", "warning"]
    for name, value in ENGINE.items():
        command += ["--" + name.replace("_", "-"), str(value)]
    process = subprocess.Popen(command, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def _cpu_share(pid: int, seconds: float) -> float:
    """CPU time the process used over ``seconds`` of wall time, as a fraction of a core."""

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime+stime

    start_cpu, start = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - start_cpu) / (time.monotonic() - start)


def _default_model() -> str:
    from minivllm.model_files import default_model_path

    return str(default_model_path())


if __name__ == "__main__":
    sys.exit(main())
