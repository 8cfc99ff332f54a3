"""Several replicas behind a router, simulated together; and the search for how many
replicas a request rate needs.

Each replica is a whole engine (its own scheduler, KV pool and simulated clock) on
``tensor_parallel_size`` devices. A router sends each request, when it arrives, to one
replica: ``round-robin`` in turn, or ``least-loaded``: the replica with the fewest
unfinished requests (Vidur's "least outstanding requests"). Replicas share nothing, so
they are simulated side by side, always advancing the one furthest behind in time: no
replica runs past the next arrival before the router has placed it.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from minivllm.bench.metrics import RequestResult, summarize
from minivllm.bench.runner import BenchRun, exact_params
from minivllm.bench.workloads import BenchRequest, Workload
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.model_info import ModelInfo
from minivllm.models.arithmetic import check_tensor_parallel, request_flops
from minivllm.models.config import ModelConfig
from minivllm.simulator.acceptance import AcceptanceProfile
from minivllm.simulator.clock import SimClock
from minivllm.simulator.executor import SimulatedExecutor
from minivllm.simulator.hardware import Hardware
from minivllm.simulator.models import preset_name
from minivllm.spec_decode import SpecDecodingStats
from minivllm.stats import StepStats

ROUTERS = ("round-robin", "least-loaded")


@dataclass
class Deployment:
    """What serves the traffic: ``num_replicas`` copies of ``model``, each on
    ``tensor_parallel_size`` devices of ``hardware``; a split the real engine would
    refuse is refused here, with its message. ``acceptance_profile``: how many draft
    tokens verify, when the engine config turns speculative decoding on."""

    model: ModelConfig
    hardware: Hardware
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    num_replicas: int = 1
    router: str = "round-robin"
    acceptance_profile: AcceptanceProfile | None = None

    def __post_init__(self) -> None:
        check_tensor_parallel(
            self.model.num_heads, self.model.num_kv_heads, self.tensor_parallel_size
        )
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")

    @property
    def model_name(self) -> str:
        return preset_name(self.model)


@dataclass
class Replica:
    engine: LLMEngine
    clock: SimClock
    executor: SimulatedExecutor
    results: list[RequestResult] = field(default_factory=list)

    @property
    def is_busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add(self, request: BenchRequest) -> None:
        self.clock.jump_to(request.arrival_time)  # an idle replica skips ahead
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        params = exact_params(request.max_tokens)
        self.engine.add_request(request.request_id, prompt, params, request.arrival_time)

    def step(self, prompt_lens: dict[str, int]) -> None:
        before = self.clock.now
        for output in self.engine.step():
            if output.finished:
                rid = output.request_id
                num_output = len(output.outputs[0].token_ids)
                self.results.append(
                    RequestResult(rid, prompt_lens[rid], num_output, output.metrics)
                )
        if self.clock.now == before:
            raise RuntimeError(
                "the engine scheduled nothing although requests are waiting: none fits "
                f"the KV pool of {self.engine.num_kv_blocks} blocks"
            )


def build_replica(config: EngineConfig, deployment: Deployment, seed: int = 0) -> Replica:
    """A real `LLMEngine` on a `SimulatedExecutor`, both reading one simulated clock;
    ``seed`` seeds the replica's draws of accepted drafts. The engine schedules
    synchronously: the simulated clock charges the GPU's time only, so there is no CPU
    time for async scheduling to hide (and one clock must not be moved by two threads)."""
    config = replace(config, async_scheduling=False)
    clock = SimClock()
    executor = SimulatedExecutor(
        deployment.model,
        deployment.hardware,
        config,
        clock,
        deployment.tensor_parallel_size,
        deployment.gpu_memory_utilization,
        deployment.acceptance_profile,
        seed,
    )
    # Prompts are token ids and outputs placeholders: no tokenizer; EOS is never reached
    # (every request has ignore_eos).
    model_info = ModelInfo(executor.model_config, tokenizer=None, eos_token_ids=frozenset())
    engine = LLMEngine(config, executor=executor, clock=clock, model_info=model_info)
    return Replica(engine, clock, executor)


def simulate(
    config: EngineConfig,
    deployment: Deployment,
    workload: Workload,
    record_steps: bool = True,
    name: str | None = None,
) -> BenchRun:
    """Run ``workload`` on the deployment; one `BenchRun` over all replicas, in
    simulated seconds (bench's table, JSON and plots take it as it is)."""
    replicas = [build_replica(config, deployment, seed) for seed in range(deployment.num_replicas)]
    if record_steps:
        for replica in replicas:
            replica.engine.record_steps()
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    prompt_lens = {r.request_id: len(r.prompt_token_ids) for r in pending}
    with _rare_collections():
        for i, request in enumerate(pending):
            _run_until(replicas, request.arrival_time, prompt_lens)
            _route(replicas, deployment.router, i).add(request)
        _run_until(replicas, math.inf, prompt_lens)

    results = [r for replica in replicas for r in replica.results]
    steps = _merged_steps(replicas) if record_steps else []
    duration = max(replica.clock.now for replica in replicas)
    summary = summarize(
        results,
        duration,
        steps,
        block_size=config.block_size,
        num_preemptions=sum(r.engine.scheduler.num_preemptions for r in replicas),
    )
    summary.model_flops = sum(
        request_flops(deployment.model, r.num_prompt_tokens, r.num_output_tokens) for r in results
    )  # the bench's useful work, so its "model GFLOP/s" row compares
    return BenchRun(
        name or config.scheduling_policy,
        summary,
        results,
        start_time=0.0,
        steps=steps,
        block_size=config.block_size,
        num_kv_blocks=replicas[0].engine.num_kv_blocks,
        spec_decoding=_spec_decoding(replicas),
    )


@contextmanager
def _rare_collections(threshold: int = 100_000):
    """Python's cycle collector, run once the heap has grown by ``threshold`` objects
    instead of 700, while the engines run. A step allocates a chunk (and its lists) per
    scheduled request, padding included; a chunk outlives a young-generation pass or two
    during its step and so reaches the old generation, to die there. Each time the
    objects that reached it come to a quarter of those living there, a full pass scans
    everything alive: every queued request and every step record kept so far. Those
    passes cost more the longer the run: a fifth to a third of the CPU time of a
    1,000-request simulation. The engine's objects die by reference
    counting, not by the collector: the simulation's peak memory is the same either way."""
    old = gc.get_threshold()
    gc.set_threshold(threshold, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _spec_decoding(replicas: list[Replica]) -> SpecDecodingStats | None:
    """The replicas' speculative-decoding counters, added up (None: speculation off)."""
    stats = [r.engine.spec_decoding_stats for r in replicas]
    if stats[0] is None:
        return None
    total = SpecDecodingStats(stats[0].num_spec_tokens)
    for s in stats:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        for position, n in enumerate(s.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[position] += n
    return total


def _run_until(replicas: list[Replica], time: float, prompt_lens: dict[str, int]) -> None:
    """Step busy replicas, the one furthest behind first, until each is idle or has
    reached ``time`` (a step in flight at ``time`` finishes: steps are not split)."""
    while True:
        behind = [r for r in replicas if r.is_busy and r.clock.now < time]
        if not behind:
            return
        min(behind, key=lambda r: r.clock.now).step(prompt_lens)


def _route(replicas: list[Replica], router: str, index: int) -> Replica:
    if router == "round-robin":
        return replicas[index % len(replicas)]
    return min(replicas, key=lambda r: r.engine.get_num_unfinished_requests())


def _merged_steps(replicas: list[Replica]) -> list[StepStats]:
    if len(replicas) == 1:
        return replicas[0].engine.take_step_stats()
    steps = [step for r in replicas for step in r.engine.take_step_stats()]
    return sorted(steps, key=lambda s: s.start_time)


# --- capacity planning ---------------------------------------------------------------


@dataclass
class SearchResult:
    num_replicas: int | None  # the fewest that meet the target; None: none up to the cap
    tried: dict[int, float]  # replicas -> P99 TTFT (s)


def search_replicas(
    config: EngineConfig,
    deployment: Deployment,
    workload: Workload,
    p99_ttft_target: float,
    max_replicas: int = 64,
) -> SearchResult:
    """The fewest replicas whose simulated P99 TTFT on ``workload`` is within the target:
    double until it is met, then bisect (more replicas never hurt TTFT here)."""
    tried: dict[int, float] = {}

    def meets(n: int) -> bool:
        if n not in tried:
            run = simulate(config, replace(deployment, num_replicas=n), workload, False)
            tried[n] = run.summary.ttft.p99
        return tried[n] <= p99_ttft_target

    high = 1
    while not meets(high):
        if high >= max_replicas:
            return SearchResult(None, tried)
        high = min(2 * high, max_replicas)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return SearchResult(high, dict(sorted(tried.items())))
