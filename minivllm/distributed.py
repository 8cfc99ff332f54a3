"""The tensor-parallel group: which rank this process is, and the two collectives the
sharded model needs, on `torch.distributed` (gloo on CPU, NCCL on CUDA).

A rank is one worker process holding one slice of every weight. Two operations join the
slices: ``all_reduce`` sums the partial outputs of a row-parallel layer (each rank
multiplied its slice of the input by its slice of the weight) so that every rank holds
the full result; ``gather_to_first`` collects the vocabulary slices of the logits on
rank 0, the one rank that samples. With one rank both are the identity and cost nothing.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """This process's place among ``size`` ranks (vLLM's tensor-model-parallel group)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        assert 0 <= rank < size
        self.rank, self.size = rank, size
        self.comm_seconds = 0.0  # wall time inside collectives, waiting included (benchmarks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over all ranks, in place; every rank gets the sum."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        dist.all_reduce(x)
        self.comm_seconds += time.perf_counter() - start
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dimension, on rank 0 only;
        the other ranks get None."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def init_tensor_parallel(
    rank: int, size: int, device: torch.device, master_port: int, timeout_s: float = 600.0
) -> TensorParallelGroup:
    """Join the process group by ``env://`` rendezvous, as ``torchrun`` sets it up: every
    rank meets rank 0 at MASTER_ADDR:MASTER_PORT (here on this machine). gloo runs the
    collectives on CPU tensors, NCCL on CUDA ones. ``timeout_s`` bounds a collective whose
    peer is gone (the executor notices a dead worker much sooner)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method="env://", timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return TensorParallelGroup(rank, size)
