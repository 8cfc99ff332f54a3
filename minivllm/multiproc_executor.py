"""`MultiprocExecutor`: the model split across ``tensor_parallel_size`` worker processes
(vLLM's ``MultiprocExecutor``).

It starts one process per rank (``spawn``: a fresh interpreter, safe with threads and
CUDA), and they form a `torch.distributed` group by ``env://`` rendezvous. Each step it
pickles the step's chunks (and block copies) once and sends the bytes down every
worker's pipe; every rank runs the same step on its slice of the model, and rank 0
answers with the sampled tokens.

Faults surface as errors, not hangs: the executor waits on the workers' pipes *and* on
their process sentinels, so a worker that raises or dies wakes it at once; it then stops
every worker and raises. Workers stop on `shutdown()`, when the executor is garbage
collected, at interpreter exit, and on their own when the engine's process disappears
(their end of the pipe closes).
"""

from __future__ import annotations

import ast
import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from minivllm.config import EngineConfig, checked_backend, resolve_max_model_len
from minivllm.models.arithmetic import check_tensor_parallel, num_blocks_for_bytes
from minivllm.models.config import ModelConfig
from minivllm.models.loader import load_model_config
from minivllm.models.model_files import resolve_model_path
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput
from minivllm.worker import WorkerError, WorkerReply, run_worker

STARTUP_TIMEOUT_S = 600.0  # importing torch and loading a shard, on a busy machine
STEP_TIMEOUT_S = 600.0  # a step that long means a stuck worker, not a slow one
STOP_TIMEOUT_S = 5.0  # for a worker to leave on its own before it is terminated


@dataclass
class WorkerHandle:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection  # the engine's end of this worker's pipe


@dataclass
class StepTiming:
    """Where one step's time went, as seen from the engine (for the benchmark)."""

    total_seconds: float  # send, every rank's step, and the replies
    execute_seconds: float  # rank 0 inside the model runner, collectives included
    comm_seconds: float  # rank 0 inside all-reduces and the logits gather
    payload_bytes: int  # the pickled chunks sent to each worker

    @property
    def compute_seconds(self) -> float:
        return self.execute_seconds - self.comm_seconds

    @property
    def transfer_seconds(self) -> float:
        """Pickling the chunks, the pipes both ways, and waking the workers."""
        return self.total_seconds - self.execute_seconds


class MultiprocExecutor:
    """``tensor_parallel_size`` workers, one slice of the model each."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()) -> None:
        tp = config.tensor_parallel_size
        model_config, _ = load_model_config(resolve_model_path(config.model))
        check_split(model_config, tp)  # everything refusable is refused before any process
        checked_backend(config)
        dtype = config.torch_dtype
        # Rank 0's device: it samples, so the requests' generators live there.
        on_cuda = config.torch_device.type == "cuda"
        self.device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
        # The memory budget is per device; a rank's block holds only its KV heads.
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_bytes(
            model_config, config.block_size, dtype, config.kv_cache_memory_bytes, tp
        )
        self.max_model_len = resolve_max_model_len(config, model_config, self.num_kv_blocks)
        self.last_step_timing: StepTiming | None = None

        self.workers = start_workers(config, eos_token_ids, self.num_kv_blocks)
        # Stops the workers when this object is collected or the interpreter exits;
        # holds the handles, not self.
        self._finalizer = weakref.finalize(self, stop_workers, self.workers)
        self._receive(STARTUP_TIMEOUT_S, "starting")  # every worker says READY

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput:
        assert not non_block, "async scheduling needs tensor_parallel_size=1 (config.py)"
        if not self._finalizer.alive:
            raise RuntimeError("the executor's workers are stopped; start a new engine")
        start = time.perf_counter()
        # The workers read only the chunks (ids, positions, block tables, sampling
        # settings) and the blocks to copy first (copy-on-write), not the engine's
        # Sequence objects: pickle once, send to all.
        step = SchedulerOutput(
            chunks=scheduler_output.chunks, blocks_to_copy=scheduler_output.blocks_to_copy
        )
        payload = pickle.dumps(step, protocol=-1)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:  # its process is gone; _receive names the cause
                break
        replies = self._receive(STEP_TIMEOUT_S, "running a step")
        first = replies[0]
        # Rank 0 sampled with copies of the requests' generators: keep their advance.
        for chunk in scheduler_output.chunks:
            if chunk.request_id in first.generator_states:
                chunk.generator.set_state(first.generator_states[chunk.request_id])
        self.last_step_timing = StepTiming(
            time.perf_counter() - start, first.execute_seconds, first.comm_seconds, len(payload)
        )
        return first.output

    def shutdown(self) -> None:
        self._finalizer()  # runs stop_workers once; later calls do nothing

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def _receive(self, timeout_s: float, doing: str) -> dict[int, WorkerReply]:
        """One reply from every worker, by rank. A worker that raises, dies or outlasts
        ``timeout_s`` stops them all and raises RuntimeError here."""
        replies: dict[int, WorkerReply] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {w.conn: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        while len(replies) < len(self.workers):
            remaining = deadline - time.monotonic()
            pending = [w.conn for w in self.workers if w.rank not in replies]
            ready = wait(pending + list(by_sentinel), timeout=max(0.0, remaining))
            if not ready:
                self._fail(f"no answer from the workers after {timeout_s:.0f} s {doing}")
            for obj in ready:
                if obj in by_conn:
                    worker, message = by_conn[obj], self._recv(by_conn[obj], doing)
                    if isinstance(message, WorkerError):
                        self._fail_with(message, worker, doing)
                    replies[worker.rank] = message
            for obj in ready:
                if obj in by_sentinel:  # a process ended: a fault, whatever it said before
                    worker = by_sentinel[obj]
                    error = last_error(worker.conn)
                    if error is not None:
                        self._fail_with(error, worker, doing)
                    worker.process.join(1.0)
                    self._fail(
                        f"tensor-parallel worker {worker.rank} (pid {worker.process.pid}) "
                        f"died with exit code {worker.process.exitcode} while {doing}"
                    )
        return replies

    def _recv(self, worker: WorkerHandle, doing: str):
        try:
            return worker.conn.recv()
        except (EOFError, OSError):  # closed, or reset by a killed process
            worker.process.join(1.0)
            self._fail(
                f"tensor-parallel worker {worker.rank} (pid {worker.process.pid}) closed "
                f"its pipe (exit code {worker.process.exitcode}) while {doing}"
            )

    def _fail_with(self, error: WorkerError, worker: WorkerHandle, doing: str):
        self._fail(
            f"tensor-parallel worker {error.rank} (pid {worker.process.pid}) raised while "
            f"{doing}:\n{error.traceback}"
        )

    def _fail(self, reason: str):
        stop_workers(self.workers, graceful=False)
        self._finalizer.detach()
        raise RuntimeError(f"{reason}\nall {len(self.workers)} workers were stopped")


def check_split(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuse a split the sharded layers cannot make, naming the numbers and the sizes
    that would work (1 and 3 for the bundled SmolLM2: 9 heads, 3 KV heads, an MLP of
    1,536)."""
    try:
        _check_split(model_config, tensor_parallel_size)
    except ValueError as e:
        sizes = ", ".join(map(str, working_split_sizes(model_config)))
        raise ValueError(f"{e}; tensor_parallel_size {sizes} would work for this model") from None


def working_split_sizes(model_config: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model's layers split into (at most one head per
    rank)."""
    sizes = []
    for tp in range(1, model_config.num_heads + 1):
        try:
            _check_split(model_config, tp)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def _check_split(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    c, tp = model_config, tensor_parallel_size
    check_tensor_parallel(c.num_heads, c.num_kv_heads, tp)
    if c.intermediate_size % tp:
        raise ValueError(
            f"the model's intermediate_size={c.intermediate_size} must be divisible by "
            f"tensor_parallel_size={tp}"
        )


def start_workers(
    config: EngineConfig, eos_token_ids: frozenset[int], num_kv_blocks: int
) -> list[WorkerHandle]:
    check_main_guard()
    context = mp.get_context("spawn")
    master_port = free_port()
    workers = []
    for rank in range(config.tensor_parallel_size):
        engine_end, worker_end = context.Pipe()
        process = context.Process(
            target=run_worker,
            args=(rank, config, eos_token_ids, num_kv_blocks, master_port, worker_end),
            name=f"minivllm-tp-worker-{rank}",
            daemon=True,  # multiprocessing ends it too if we exit without shutdown
        )
        process.start()
        worker_end.close()  # the worker holds its end; EOF reaches us when it exits
        workers.append(WorkerHandle(rank, process, engine_end))
    return workers


def check_main_guard() -> None:
    """Refuse, in one line, to start workers from a script's top level.

    A ``spawn`` worker imports the main script again; a script that builds its `LLM` at
    top level, not under ``if __name__ == "__main__":``, would then build it again in every
    worker, and multiprocessing fails each with a page of traceback. (vLLM forks its workers
    on Linux, where such a script runs; fork is not safe with the threads torch and the
    engine start, so minivllm spawns.) A REPL, a notebook or ``python -c`` is never imported
    again: nothing to check."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not os.path.isfile(path):
        return
    # The script's own top-level frame, however deep the call into minivllm came from.
    frame, top = sys._getframe(1), None
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return
    with open(path, encoding="utf-8") as f:
        line = unguarded_line(f.read(), top.f_lineno)
    if line is not None:
        raise RuntimeError(
            f"{path}:{line} starts tensor-parallel workers at the script's top level: put "
            'that code under `if __name__ == "__main__":` (each worker imports the script '
            "again, and would start its own)"
        )


def unguarded_line(source: str, lineno: int) -> int | None:
    """``lineno`` if that line of the script ``source`` runs at import time, i.e. is not
    inside an ``if __name__ == "__main__":`` block (nor a function or class body); else
    None."""
    tree = ast.parse(source)
    for node in tree.body:
        if not node.lineno <= lineno <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None
        if isinstance(node, ast.If) and _is_main_test(node.test):
            in_body = any(n.lineno <= lineno <= (n.end_lineno or n.lineno) for n in node.body)
            return None if in_body else lineno
        return lineno
    return lineno


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    name = ast.dump(ast.Name("__name__", ast.Load()))
    return isinstance(test.ops[0], ast.Eq) and sides == {name, ast.dump(ast.Constant("__main__"))}


def stop_workers(workers: list[WorkerHandle], graceful: bool = True) -> None:
    """Ask each worker to leave, give them `STOP_TIMEOUT_S`, then terminate and kill."""
    if graceful:
        for worker in workers:
            with contextlib.suppress(OSError):  # already gone
                worker.conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
    for worker in workers:
        worker.process.join(STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def last_error(conn: Connection) -> WorkerError | None:
    """The `WorkerError` a dead worker sent before exiting, if it sent one."""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll():
            message = conn.recv()
            if isinstance(message, WorkerError):
                return message
    return None


def free_port() -> int:
    """A TCP port nobody listens on now, for the rendezvous (rank 0 binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
