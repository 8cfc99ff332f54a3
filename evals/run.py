"""Score `minivllm serve` with EleutherAI's lm-evaluation-harness, the way vLLM servers are
scored, and check the scores against lm-eval's own transformers backend.

lm-eval talks to an OpenAI-compatible server through its ``local-completions`` model: a
multiple-choice item becomes one ``/v1/completions`` request per choice with ``echo: true``,
``logprobs: 1`` and ``max_tokens: 1`` (the prompt's own log-probabilities come back, and
the choice's tokens are summed), a ``generate_until`` item one greedy completion with
``stop``. Its ``hf`` model runs the same checkpoint through transformers in this process.
The two see the same token ids (``tokenized_requests``: lm-eval tokenizes, with the
checkpoint's own tokenizer), so on the same float32 weights they must give the same
scores; per item, the log-likelihoods agree to float noise (the server batches requests
together, which changes the order of the sums).

``make eval`` runs this: start the server on a free port, run the bundled tasks
(evals/tasks/) through it, stop it, run them through ``hf``, print both tables and whether
they are equal. Everything is offline: the tasks read JSON files from this repository and
both backends load the tokenizer from the converted checkpoint's folder.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "evals" / "tasks"
TASKS = ["minivllm_facts", "minivllm_capitals"]
SERVED_MODEL_NAME = "smollm2"
# No Hugging Face Hub lookups: the datasets are local JSON files, the tokenizer and the
# weights a local folder.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `minivllm serve` process that may still be starting."""

    url: str
    process: subprocess.Popen
    log: IO[bytes]

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until /health answers; raises with the server's output if it exits first."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"minivllm serve exited:\n{self.log.read().decode()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"minivllm serve did not answer in {timeout_s} s")
            time.sleep(0.2)


@contextlib.contextmanager
def serve(
    model_path: Path, threads: int, device: str = "cpu", quantization: str | None = None
) -> Iterator[Server]:
    """A real `minivllm serve` process on a free 127.0.0.1 port, for the ``with`` block
    (call `Server.wait_ready` before sending it requests: something else can run while
    it loads). The process is always stopped (SIGTERM, then SIGKILL) on the way out,
    whatever happened inside."""
    port = free_port()
    command = [sys.executable, "-m", "minivllm.cli", "serve", "--model", str(model_path),
               "--served-model-name", SERVED_MODEL_NAME, "--port", str(port),
               "--threads", str(threads), "--dtype", "float32", "--device", device,
               "--log-level", "warning", "--disable-log-stats"]  # fmt: skip
    if quantization is not None:  # the server's weights only; hf stays float32
        command += ["--quantization", quantization]
    env = os.environ | OFFLINE | {"PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would block it
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield Server(f"http://127.0.0.1:{port}", process, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def _in_repo() -> Iterator[None]:
    """The task files name their data relative to the repository root."""
    before = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(before)


def run_lm_eval(model: str, model_args: dict, limit: int | None = None) -> dict:
    """lm-eval's `simple_evaluate` on the bundled tasks, one request at a time (batch size
    1: the server takes one prompt per request; ``num_concurrent`` sends several)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.update(OFFLINE)
    with _in_repo():
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=TASKS,
            # Only ours: indexing lm-eval's thousands of bundled tasks takes ~10 s of CPU.
            task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
            batch_size=1,
            limit=limit,
            log_samples=True,
        )


def server_model_args(url: str, model_path: Path, num_concurrent: int) -> dict:
    return {
        "base_url": url + "/v1/completions",
        "model": SERVED_MODEL_NAME,
        "tokenizer": str(model_path),  # a local folder: no Hub lookup
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # send token ids: both backends score the same ids
        "num_concurrent": num_concurrent,
        "max_retries": 1,  # a failed request is an error to see, not to retry
        "timeout": 600,
    }


def hf_model_args(model_path: Path, device: str = "cpu") -> dict:
    return {"pretrained": str(model_path), "dtype": "float32", "device": device}


# --- comparing two runs ------------------------------------------------------------------


def scores(results: dict) -> dict[tuple[str, str], float]:
    """(task, "metric,filter") -> value, without the standard errors."""
    return {
        (task, key): value
        for task, row in results["results"].items()
        for key, value in row.items()
        if "," in key and "_stderr" not in key
    }


def loglikelihoods(results: dict) -> dict[tuple[str, int, int], float]:
    """(task, doc_id, choice) -> the choice's log-likelihood, for the multiple-choice tasks."""
    return {
        (task, sample["doc_id"], i): float(resp[0][0])
        for task, samples in results["samples"].items()
        for sample in samples
        for i, resp in enumerate(sample["resps"])
        if isinstance(resp[0], tuple | list)
    }


def generations(results: dict) -> dict[tuple[str, int], list]:
    """(task, doc_id) -> the raw generated texts, for the generate_until tasks."""
    return {
        (task, sample["doc_id"]): sample["resps"]
        for task, samples in results["samples"].items()
        for sample in samples
        if isinstance(sample["resps"][0][0], str)
    }


@dataclass
class Comparison:
    scores_equal: bool
    generations_equal: bool
    max_loglikelihood_diff: float
    num_loglikelihoods: int

    @classmethod
    def of(cls, server: dict, hf: dict) -> Comparison:
        a, b = loglikelihoods(server), loglikelihoods(hf)
        assert a.keys() == b.keys()
        diffs = [abs(a[k] - b[k]) for k in a]
        return cls(
            scores_equal=scores(server) == scores(hf),
            generations_equal=generations(server) == generations(hf),
            max_loglikelihood_diff=max(diffs, default=math.nan),
            num_loglikelihoods=len(diffs),
        )

    def summary(self) -> str:
        verdict = "equal" if self.scores_equal else "NOT equal"
        return (
            f"scores: {verdict} (generations {'equal' if self.generations_equal else 'differ'};"
            f" largest per-choice log-likelihood difference {self.max_loglikelihood_diff:.1e}"
            f" over {self.num_loglikelihoods} choices)"
        )


def cpu_seconds() -> float:
    """CPU time of this process and of the finished processes it started (the server)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: the bundled one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, each backend")
    parser.add_argument("--num-concurrent", type=int, default=4,
                        help="requests lm-eval keeps in flight")  # fmt: skip
    parser.add_argument("--device", default="cpu",
                        help="where both backends run: cpu or cuda (float32 both)")  # fmt: skip
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--quantization", default=None, choices=("int8", "gguf"),
                        help="the server's weight format (hf stays float32)")  # fmt: skip
    args = parser.parse_args(argv)

    import torch
    from lm_eval.utils import make_table

    from minivllm.models.model_files import resolve_model_path

    # A SIGTERM (make interrupted, a CI timeout) unwinds like Ctrl-C: `serve` stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    start, start_cpu = time.perf_counter(), cpu_seconds()
    with serve(model_path, args.threads, args.device, args.quantization) as process:
        process.wait_ready()
        up = time.perf_counter()
        print(f"== minivllm serve at {process.url} (up in {up - start:.0f} s): "
              "lm-eval local-completions")  # fmt: skip
        model_args = server_model_args(process.url, model_path, args.num_concurrent)
        server = run_lm_eval("local-completions", model_args, args.limit)
        server_s = time.perf_counter() - up
    server_cpu = cpu_seconds() - start_cpu  # the server's whole life and lm-eval's client
    print(make_table(server))
    print(f"== lm-eval hf (transformers, float32) on {model_path}")
    hf_start, hf_start_cpu = time.perf_counter(), cpu_seconds()
    hf = run_lm_eval("hf", hf_model_args(model_path, args.device), args.limit)
    hf_s, hf_cpu = time.perf_counter() - hf_start, cpu_seconds() - hf_start_cpu
    print(make_table(hf))
    comparison = Comparison.of(server, hf)
    print(
        f"time: local-completions {server_s:.0f} s after {up - start:.0f} s of server "
        f"start-up ({server_cpu:.0f} s CPU, server and client, start-up included); hf "
        f"{hf_s:.0f} s ({hf_cpu:.0f} s CPU); {time.perf_counter() - start:.0f} s in all"
    )
    print(comparison.summary())
    return 0 if comparison.scores_equal and comparison.generations_equal else 1


if __name__ == "__main__":
    sys.exit(main())
