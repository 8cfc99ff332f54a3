"""How fast this machine multiplies matrices and reads memory, measured now: the two
rates of a roofline; and, for tensor parallelism, how long an all-reduce between worker
processes takes here (a link's latency and bandwidth). `hardware.measure_this_cpu` turns
them into a `Hardware` preset for the simulator; the bench records the matmul peak beside
its runs, and the benchmark scripts draw their rooflines from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch


def matmul_candidates(size: int = 1024) -> dict[str, Callable[[], torch.Tensor]]:
    """The fp32 GEMMs this machine can run a ``size``-square product with, as no-argument
    calls: ``torch.mm`` and the model's own `Linear` (prepacked for oneDNN where this
    torch build can). The faster one is the peak: on an AMD CPU, MKL's ``torch.mm`` can
    take a slower code path than oneDNN (on the development box 100 against 220 GFLOP/s
    on one thread), and a roofline drawn from the slower one lets prefill look faster
    than the peak."""
    from minivllm.models.linear import Linear

    a, b = torch.randn(size, size), torch.randn(size, size)
    layer = Linear(size, size, bias=False)
    layer.process_weights_after_loading()
    return {"torch.mm": lambda: torch.mm(a, b), "Linear": lambda: layer(a)}


def measure_matmul_peak(size: int = 1024, seconds: float = 1.0) -> float:
    """This machine's fp32 matrix-multiply speed right now, in GFLOP/s, with torch's
    current thread count: the roofline that no step of the model can beat. The faster of
    `matmul_candidates`, each timed for half of ``seconds``."""
    best = 0.0
    with torch.inference_mode():
        for gemm in matmul_candidates(size).values():
            gemm()  # warm-up
            num_calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 2:
                gemm()
                num_calls += 1
            best = max(best, 2 * size**3 * num_calls / elapsed / 1e9)
    return best


def measure_read_bandwidth(num_bytes: int = 256 << 20, seconds: float = 0.5) -> float:
    """Bytes/s a reduction reads from memory (a tensor far larger than the caches)."""
    x = torch.ones(num_bytes // 4)
    x.sum()  # warm-up
    num_calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        x.sum()
        num_calls += 1
    return num_bytes * num_calls / elapsed


# --- the link between tensor-parallel ranks -----------------------------------------

# Message sizes for the link fit, in fp32 elements: a decode step's activations (a few
# rows of the hidden size), a prefill chunk's (hundreds of rows), and one large enough
# that its transfer time stands out of the noise of a busy machine.
LINK_PROBE_NUMEL = (512, 131072, 1 << 20)  # 2 KiB, 512 KiB, 4 MiB
LINK_PROBE_TIMEOUT_S = 300.0  # spawning tp interpreters that import torch, on a busy box


def fit_ring_allreduce(
    message_bytes: list[int], seconds: list[float], tp: int
) -> tuple[float, float]:
    """The (latency per hop in s, bandwidth in bytes/s) of a ring all-reduce over ``tp``
    ranks that best fit the timings (least squares on the cost model's formula,
    ``2 (tp - 1) latency + 2 (tp - 1) / tp * bytes / bandwidth``). A slope that is not
    positive (the larger message was no slower: noise) reads as an unlimited bandwidth;
    a negative intercept as no latency."""
    if tp < 2:
        raise ValueError(f"an all-reduce needs at least 2 ranks, got tp={tp}")
    slope, intercept = np.polyfit(message_bytes, seconds, 1)
    latency = max(0.0, float(intercept)) / (2 * (tp - 1))
    bandwidth = 2 * (tp - 1) / tp / slope if slope > 0 else float("inf")
    return latency, float(bandwidth)


def measure_allreduce_link(
    tp: int, numels: tuple[int, ...] = LINK_PROBE_NUMEL, repeats: int = 30
) -> tuple[float, float]:
    """Time a gloo all-reduce of fp32 tensors among ``tp`` processes on 127.0.0.1,
    started as the executor starts its workers (spawn, one torch thread each, the same
    ``env://`` rendezvous), and fit `fit_ring_allreduce`. Every process is ended and
    checked gone before this returns."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from minivllm.multiproc_executor import WorkerHandle, free_port, stop_workers

    context, port = mp.get_context("spawn"), free_port()
    handles = []
    try:
        for rank in range(tp):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_time_allreduce,
                args=(rank, tp, port, numels, repeats, sender),
                name=f"minivllm-link-probe-{rank}",
                daemon=True,
            )
            process.start()
            sender.close()  # EOF reaches us if the rank dies before answering
            handles.append(WorkerHandle(rank, process, receiver))
        first = handles[0]
        if not wait([first.conn], timeout=LINK_PROBE_TIMEOUT_S):
            raise RuntimeError(f"the all-reduce probe on {tp} ranks gave no answer")
        try:
            seconds = first.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the all-reduce probe's rank 0 exited with {first.process.exitcode}"
            ) from None
        for handle in handles:
            handle.process.join(LINK_PROBE_TIMEOUT_S)
    finally:
        stop_workers(handles, graceful=False)  # terminates any rank still there
    alive = [h.process.pid for h in handles if h.process.is_alive()]
    assert not alive, f"link probe processes still running: {alive}"
    return fit_ring_allreduce([4 * n for n in numels], seconds, tp)


def _time_allreduce(rank, tp, port, numels, repeats, conn) -> None:
    """One probe rank: the median time of ``repeats`` all-reduces per message size, as
    rank 0 sees it (each call waits for the slowest rank, as in a real step)."""
    import statistics

    import torch.distributed as dist

    from minivllm.distributed import init_tensor_parallel

    torch.set_num_threads(1)  # as a CPU worker runs
    group = init_tensor_parallel(rank, tp, torch.device("cpu"), port, timeout_s=60.0)
    try:
        medians = []
        for numel in numels:
            x = torch.zeros(numel)  # sums stay 0: no overflow over the repeats
            for _ in range(3):  # warm-up: gloo sets up its buffers on first use
                group.all_reduce(x)
            dist.barrier()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                group.all_reduce(x)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        if rank == 0:
            conn.send(medians)
    finally:
        dist.destroy_process_group()
        conn.close()
