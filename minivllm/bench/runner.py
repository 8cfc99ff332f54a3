"""Drive an `LLMEngine` through a workload and measure it.

The loop is what a server does: between two engine steps, every request whose arrival
time has come enters the engine (`add_request`, stamped with its scheduled arrival time,
so time spent waiting for the current step counts as queueing). Offline, everything
arrives at t=0. ``max_concurrency`` holds requests back client-side while that many are
in flight (vLLM's ``--max-concurrency``); a held request's clock starts when it is sent.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm

from minivllm.bench.metrics import RequestResult, RunSummary, summarize
from minivllm.bench.workloads import BenchRequest, Workload
from minivllm.config import EngineConfig
from minivllm.engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.spec_decode import SpecDecodingStats
from minivllm.stats import StepStats


@dataclass
class BenchRun:
    """One measured run: its summary and the raw records the plots are drawn from."""

    name: str
    summary: RunSummary
    requests: list[RequestResult]
    start_time: float  # perf_counter at t=0; every timestamp is on that clock
    steps: list[StepStats] = field(default_factory=list)
    output_token_ids: dict[str, list[int]] = field(default_factory=dict)
    block_size: int | None = None  # the KV cache's, for minivllm runs
    num_kv_blocks: int | None = None
    spec_decoding: SpecDecodingStats | None = None  # counted over the measured run only


def exact_params(max_tokens: int) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` tokens: identical work under every policy."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def run_engine(
    config: EngineConfig,
    workload: Workload,
    max_concurrency: int | None = None,
    progress: bool = True,
    engine: LLMEngine | None = None,
) -> BenchRun:
    """Run ``workload`` on a fresh engine built from ``config`` (or on ``engine``) after a
    short warm-up, and measure it."""
    if max_concurrency is not None and max_concurrency < 1:  # would never send a request
        raise ValueError(f"max_concurrency must be a positive int or None, got {max_concurrency}")
    if engine is None:  # built here: closed here too (its tensor-parallel workers)
        engine = LLMEngine(config)
        try:
            return run_engine(config, workload, max_concurrency, progress, engine)
        finally:
            engine.close()
    _warm_up(engine, workload)
    before = engine.make_stats()  # the totals the warm-up left
    engine.record_steps()
    desc = f"minivllm {engine.config.scheduling_policy}"
    with tqdm(total=len(workload.requests), desc=desc, disable=not progress) as bar:
        start, results, token_ids = _drive(engine, workload, max_concurrency, bar)
    duration = time.perf_counter() - start
    steps = engine.take_step_stats()
    after = engine.make_stats()
    summary = summarize(
        results,
        duration,
        steps,
        block_size=engine.config.block_size,
        num_preemptions=sum(len(s.preempted_ids) for s in steps),
        prefix_cache_hit_rate=(
            after.prefix_cache.hit_rate if engine.config.enable_prefix_caching else None
        ),
    )
    policy, block_size = engine.config.scheduling_policy, engine.config.block_size
    spec = after.spec_decoding
    return BenchRun(
        policy, summary, results, start, steps, token_ids, block_size, engine.num_kv_blocks,
        spec - before.spec_decoding if spec is not None else None,
    )  # fmt: skip


def _drive(engine: LLMEngine, workload: Workload, max_concurrency: int | None, bar):
    pending = deque(sorted(workload.requests, key=lambda r: r.arrival_time))
    prompt_lens = {r.request_id: len(r.prompt_token_ids) for r in workload.requests}
    results: list[RequestResult] = []
    token_ids: dict[str, list[int]] = {}
    limit = max_concurrency or len(pending)
    in_flight = 0
    slot_freed_at = 0.0  # when the concurrency limit last stopped binding
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + pending[0].arrival_time <= now and in_flight < limit:
            request = pending.popleft()
            sent = max(start + request.arrival_time, slot_freed_at)
            _add(engine, request, sent)
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0].arrival_time - time.perf_counter()))
            continue
        was_full = in_flight >= limit
        for output in engine.step():
            if not output.finished:
                continue
            in_flight -= 1
            num_output = len(output.outputs[0].token_ids)
            rid = output.request_id
            results.append(RequestResult(rid, prompt_lens[rid], num_output, output.metrics))
            token_ids[rid] = output.outputs[0].token_ids
            bar.update(1)
        if was_full and in_flight < limit:
            slot_freed_at = time.perf_counter()
    return start, results, token_ids


def _add(engine: LLMEngine, request: BenchRequest, arrival_time: float) -> None:
    prompt = {"prompt_token_ids": request.prompt_token_ids}
    engine.add_request(request.request_id, prompt, exact_params(request.max_tokens), arrival_time)


def _warm_up(engine: LLMEngine, workload: Workload) -> None:
    """A couple of short requests first, so one-time costs (allocator, kernel caches,
    numba compiles) are not billed to the measured run; then forget what they left in the
    prefix cache and its hit counters, so the run starts cold and counts only itself."""
    prompt = {"prompt_token_ids": workload.requests[0].prompt_token_ids[:32]}
    for i in range(2):
        engine.add_request(f"warmup-{i}", prompt, exact_params(4))
    # With async scheduling a step is still in flight once the requests are done (it was
    # scheduled before their last tokens were known): report it too, or the measured run
    # would begin by reporting the warm-up.
    while engine.has_unfinished_requests() or engine.in_flight is not None:
        engine.step()
    was_reset = engine.reset_prefix_cache()
    assert was_reset, "nothing is in flight after the warm-up"
