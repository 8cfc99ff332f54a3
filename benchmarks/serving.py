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

# Prefix caching off under both policies (static has none): batching alone differs.
ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "max_model_len": 512,
    "enable_prefix_caching": False,
}


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
    direct, http, direct_busy, http_busy = [], [], [], []
    direct_cpu = http_cpu = client_cpu = 0.0  # CPU seconds, summed over the repeats
    with _server(model, args.threads, "continuous") as (url, pid):
        idle_cpu = _cpu_share(pid, seconds=5.0)
        for _ in range(args.repeat):
            cpu = time.process_time()
            run = run_engine(config, workload, args.max_concurrency, progress=False)
            direct_cpu += time.process_time() - cpu
            direct.append(run.summary.output_throughput)
            direct_busy.append(_busy([(s.start_time, s.end_time) for s in run.steps]))
            cpu, server_cpu = time.process_time(), _cpu_seconds(pid)
            first_step = httpx.get(url + "/live/state?since=1000000000").json()["num_steps"]
            run = run_http(url, workload, args.max_concurrency, progress=False)
            client_cpu += time.process_time() - cpu
            http_cpu += _cpu_seconds(pid) - server_cpu
            http.append(run.summary.output_throughput)
            steps = httpx.get(f"{url}/live/state?since={first_step + 1}").json()["steps"]
            http_busy.append(_busy([(s["start"], s["end"]) for s in steps]))
    tokens = workload.num_output_tokens * args.repeat
    print(f"\n{workload.describe()}, {args.max_concurrency} concurrent streams")
    print("in process (engine driven directly), output tokens/s:", _list(direct))
    print("through HTTP (minivllm serve),       output tokens/s:", _list(http))
    ratios = [1 - h / d for d, h in zip(direct, http)]
    print("HTTP overhead per pair (1 - http / in process):", ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"HTTP overhead, total: {1 - sum(http) / sum(direct):+.1%}")
    print(
        f"CPU ms per output token: in process {1e3 * direct_cpu / tokens:.1f}, "
        f"server process {1e3 * http_cpu / tokens:.1f} "
        f"({http_cpu / direct_cpu - 1:+.1%}), benchmark client {1e3 * client_cpu / tokens:.1f}"
    )
    busy = f"{_list(direct_busy, '%')} in process, {_list(http_busy, '%')} through HTTP"
    print(f"engine busy (time in steps / first to last step): {busy}")
    print(f"idle server process CPU over 5 s: {idle_cpu:.2%} of one core")
    return 0


def _list(values: list[float], unit: str = "") -> str:
    if unit == "%":
        return ", ".join(f"{v:.1%}" for v in values)
    return ", ".join(f"{v:.1f}" for v in values)


def _busy(steps: list[tuple[float, float]]) -> float:
    """The fraction of the time from the first step's start to the last step's end that
    the engine spent inside steps (the rest: between steps, or idle)."""
    span = steps[-1][1] - steps[0][0]
    return sum(end - start for start, end in steps) / span


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
    command = [sys.executable, "-m", "minivllm.cli", "serve"]
    command += ["--model", model, "--port", str(port), "--threads", str(threads)]
    command += ["--scheduling-policy", policy, "--log-level", "warning"]
    for name, value in ENGINE.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # an on/off flag: --name or --no-name
            command.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            command += [f"--{flag}", str(value)]
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_share(pid: int, seconds: float) -> float:
    """CPU time the process used over ``seconds`` of wall time, as a fraction of a core."""
    start_cpu, start = _cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_seconds(pid) - start_cpu) / (time.monotonic() - start)


def _default_model() -> str:
    from minivllm.models.model_files import default_model_path

    return str(default_model_path())


if __name__ == "__main__":
    sys.exit(main())
