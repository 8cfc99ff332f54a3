"""One tensor-parallel rank: a worker process that holds its slice of the model and the
KV cache of its heads, and runs every step it is sent (vLLM's ``Worker`` and its busy
loop in ``MultiprocExecutor``).

The worker knows nothing of requests beyond each step's chunks: the scheduler, block
tables and prefix cache live once, in the engine's process, and every rank receives the
same chunks, so the same slots. Rank 0 alone gets the logits and samples; it answers
with the sampled tokens, the other ranks with an acknowledgement.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from minivllm.config import EngineConfig
from minivllm.distributed import init_tensor_parallel
from minivllm.model_runner import ModelRunner
from minivllm.models.loader import load_model
from minivllm.models.model_files import resolve_model_path
from minivllm.outputs import ModelRunnerOutput
from minivllm.scheduler_output import SchedulerOutput


@dataclass
class WorkerReply:
    """What a rank answers a step: rank 0 the sampled tokens and the advanced state of
    each random-sampling request's generator (the engine's copy stays the one truth);
    every rank its time inside the step and inside collectives."""

    output: ModelRunnerOutput | None = None
    generator_states: dict[str, torch.Tensor] = field(default_factory=dict)
    execute_seconds: float = 0.0
    comm_seconds: float = 0.0


@dataclass
class WorkerError:
    """A worker's exception, sent before it exits."""

    rank: int
    traceback: str


READY = "ready"


class Worker:
    def __init__(
        self,
        rank: int,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        num_kv_blocks: int,
        master_port: int,
    ) -> None:
        from minivllm.config import checked_backend

        size = config.tensor_parallel_size
        if config.torch_device.type == "cuda":
            self.device = torch.device("cuda", rank)  # one GPU per rank
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)  # one core per rank: ranks don't fight over cores
        self.rank = rank
        self.tp = init_tensor_parallel(rank, size, self.device, master_port)
        dtype = config.torch_dtype
        model, _ = load_model(
            resolve_model_path(config.model), checked_backend(config)(), dtype, self.device,
            self.tp, config.quantization,
        )  # fmt: skip
        self.model_runner = ModelRunner(
            model, num_kv_blocks, config.block_size, dtype, self.device, eos_token_ids, size
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> WorkerReply:
        start, comm_before = time.perf_counter(), self.tp.comm_seconds
        output = self.model_runner.execute_model(scheduler_output)
        reply = WorkerReply(
            execute_seconds=time.perf_counter() - start,
            comm_seconds=self.tp.comm_seconds - comm_before,
        )
        if self.rank == 0:
            reply.output = output
            reply.generator_states = {
                c.request_id: c.generator.get_state()
                for c in scheduler_output.chunks
                if c.sample and c.generator is not None
            }
        return reply

    def busy_loop(self, conn: Connection) -> None:
        """Run steps until told to stop (None) or the engine's end of the pipe closes."""
        while True:
            try:
                scheduler_output = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the engine's process is gone: so are we
                return
            if scheduler_output is None:
                return
            conn.send(self.execute_model(scheduler_output))


def run_worker(
    rank: int,
    config: EngineConfig,
    eos_token_ids: frozenset[int],
    num_kv_blocks: int,
    master_port: int,
    conn: Connection,
) -> None:
    """A worker process's whole life: join the group, load the shard, serve steps. An
    exception goes back to the engine as a `WorkerError`, then the process exits."""
    # Ctrl-C reaches every process of the terminal's group; stopping is the engine's call
    # (it tells us, or its end of the pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = Worker(rank, config, eos_token_ids, num_kv_blocks, master_port)
        conn.send(READY)
        worker.busy_loop(conn)
    except Exception:
        with contextlib.suppress(OSError):  # the engine may be gone already
            conn.send(WorkerError(rank, traceback.format_exc()))
        sys.exit(1)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
