"""Hardware presets for the simulator: a device's peak figures and how much of them a
serving engine achieves.

GPU figures are the vendors' spec-sheet numbers for dense BF16 tensor math (NVIDIA's
pages headline the 2:4-sparsity figure, twice the dense one; LLM matmuls are dense) and
memory bandwidth; sources are cited in the docs chapter "What a GPU would do". The
``*_efficiency`` fractions and the per-step overhead are assumptions, not measurements:
no kernel reaches the spec sheet, and an engine spends some time per step outside the
model (scheduling, sampling, launching kernels). ``this-cpu`` is measured on the spot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One device. Tensor parallelism uses ``N`` of them, linked at ``link_bandwidth``."""

    name: str
    peak_flops: float  # FLOP/s, dense, in the dtype below
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    dtype_bytes: int  # weights and KV: 2 for BF16 on GPUs, 4 for fp32 on the CPU
    link_bandwidth: float  # bytes/s per device per direction, for all-reduce
    flops_efficiency: float = 0.7  # achievable / peak (assumed for GPUs)
    bandwidth_efficiency: float = 0.85  # achievable / peak (assumed for GPUs)
    step_overhead_s: float = 1e-3  # per step, outside the model (assumed for GPUs)
    # One step of a ring all-reduce (2 (tp - 1) steps each): NCCL's low-latency protocols
    # take 1-2 us per hop over NVLink (assumed the same over PCIe: small messages).
    link_latency_s: float = 2e-6

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    @property
    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency


# Vendors' "GB" of device memory are read as GiB: an H200 ("141 GB") reports about
# 139 GiB to CUDA, which 141 x 10^9 bytes (131 GiB) would not reach.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in [
        # NVLink 4: 900 GB/s per GPU in total, 450 GB/s each way.
        Hardware("h200", 989e12, 4.8e12, 141 * GiB, 2, link_bandwidth=450e9),
        Hardware("h100", 989e12, 3.35e12, 80 * GiB, 2, link_bandwidth=450e9),
        # NVLink 3: 600 GB/s per GPU in total.
        Hardware("a100-80gb", 312e12, 2.039e12, 80 * GiB, 2, link_bandwidth=300e9),
        # No NVLink: PCIe Gen4 x16, 64 GB/s in total.
        Hardware("l4", 121e12, 300e9, 24 * GiB, 2, link_bandwidth=32e9),
    ]
}
HARDWARE_CHOICES = (*HARDWARE, "this-cpu")


def get_hardware(name: str) -> Hardware:
    """A preset by name; ``this-cpu`` is measured now (a second or two)."""
    if name == "this-cpu":
        return measure_this_cpu()
    if name not in HARDWARE:
        raise ValueError(
            f"unknown hardware preset {name!r}; choose from {', '.join(HARDWARE_CHOICES)}"
        )
    return HARDWARE[name]


def measure_this_cpu(
    seconds: float = 0.5, step_overhead_s: float = 0.0, tensor_parallel_size: int = 1
) -> Hardware:
    """This machine, measured just now with torch's current thread count: the fp32
    matmul rate and the rate at which a sum streams a large tensor from memory, taken as
    achieved rates (efficiencies 1). With ``tensor_parallel_size`` > 1, the link too: a
    gloo all-reduce among that many processes here, fitted to a latency per hop and a
    bandwidth. `calibrate.py` fits the per-step overhead and the efficiency of the
    model's own steps from a real run."""
    from minivllm.bench.hardware_probe import (
        measure_allreduce_link,
        measure_matmul_peak,
        measure_read_bandwidth,
    )

    flops = measure_matmul_peak(size=1024, seconds=seconds) * 1e9
    link_latency_s, link_bandwidth = 0.0, float("inf")  # one device: nothing to send
    if tensor_parallel_size > 1:
        link_latency_s, link_bandwidth = measure_allreduce_link(tensor_parallel_size)
    return Hardware(
        "this-cpu",
        peak_flops=flops,
        memory_bandwidth=measure_read_bandwidth(seconds=seconds),
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        dtype_bytes=4,
        link_bandwidth=link_bandwidth,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        step_overhead_s=step_overhead_s,
        link_latency_s=link_latency_s,
    )


def with_overrides(hardware: Hardware, **changes) -> Hardware:
    """A copy with some figures changed (e.g. a fitted ``step_overhead_s``)."""
    return replace(hardware, **changes)
