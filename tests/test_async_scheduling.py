"""Async scheduling (on by default on a CUDA device, off on a CPU) changes when the engine's
bookkeeping runs, never what it computes: every request's tokens, text and finish reason
equal the synchronous engine's (``async_scheduling=False``), in every scheduling regime,
and the pool ends empty. Every differential test asks for it explicitly, so it runs both
ways on any device. Where it is not supported the default falls back, with the reason;
asked for explicitly there, it is refused."""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.async_scheduler import AsyncScheduler
from minivllm.config import EngineConfig
from minivllm.kv_cache_manager import hash_block_tokens
from minivllm.scheduler import Scheduler
from minivllm.static_scheduler import StaticBatchScheduler

REGIMES = {
    "roomy": dict(block_size=4, num_kv_blocks=256),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=24, max_model_len=96,
                       enable_prefix_caching=False),
    "preemption_cached": dict(block_size=4, num_kv_blocks=24, max_model_len=96),
    "few_seqs": dict(block_size=7, num_kv_blocks=256, max_num_seqs=3),
}  # fmt: skip


def _prompts(num: int, shared_prefix: int = 0) -> list[list[int]]:
    prefix = [(5 * j) % 250 + 3 for j in range(shared_prefix)]
    lengths = [1 + (13 * i) % 40 for i in range(num)]
    return [
        [1] + prefix + [(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lengths)
    ]


def _params(i: int, stop_token: int | None) -> SamplingParams:
    """A mix: greedy to max_tokens, EOS honoured, a stop token, seeded sampling, penalties."""
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=3 + i % 11, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0, max_tokens=16)
    if kind == 2:
        return SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])
    if kind == 3:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3,
                          min_tokens=4)  # fmt: skip


def _run(path, prompts, params, **options):
    llm = LLM(model=str(path), **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    result = [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs
    ]
    return llm, result


@pytest.mark.parametrize("regime", REGIMES)
def test_outputs_equal_with_and_without_async_scheduling(tiny_llama_path, regime):
    prompts = _prompts(14, shared_prefix=9 if regime == "preemption_cached" else 0)
    _, probe = _run(tiny_llama_path, prompts[:1], SamplingParams(temperature=0, max_tokens=6,
                    ignore_eos=True), **REGIMES[regime])  # fmt: skip
    stop_token = probe[0][0][0][3]  # appears in some outputs, so some requests stop on it
    params = [_params(i, stop_token) for i in range(len(prompts))]
    sync, expected = _run(tiny_llama_path, prompts, params, async_scheduling=False,
                          **REGIMES[regime])  # fmt: skip
    llm, got = _run(tiny_llama_path, prompts, params, async_scheduling=True, **REGIMES[regime])
    assert got == expected
    assert isinstance(llm.llm_engine.scheduler, AsyncScheduler)
    assert type(sync.llm_engine.scheduler) is Scheduler
    if regime.startswith("preemption"):
        assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("regime", ["roomy", "chunked", "preemption_cached", "few_seqs"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_registers_the_same_blocks(tiny_llama_path, regime, async_scheduling):
    """After every step, each running request has registered exactly its blocks full of
    tokens that are computed (scheduled, under async scheduling) and were known before
    the step, with the right hashes: the same rule with and without async scheduling. The
    async scheduler registers a block whose last token was a placeholder at the request's
    next schedule, which relies on every running request being scheduled in every step,
    budget ("chunked") and preemption notwithstanding: checked too."""
    llm = LLM(model=str(tiny_llama_path), async_scheduling=async_scheduling, **REGIMES[regime])
    engine = llm.llm_engine
    kv, block_size = engine.kv_cache_manager, engine.kv_cache_manager.block_size
    for i, prompt in enumerate(_prompts(14, shared_prefix=9)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, _params(i, stop_token=7))
    num_checked = 0
    while engine.has_unfinished_requests():
        known = {r: seq.num_tokens for r, seq in engine.scheduler.requests.items()}
        engine.step()
        for seq in engine.scheduler.running:
            assert seq.request_id in engine.last_step.num_scheduled_tokens
            num_full = min(seq.num_computed_tokens, known[seq.request_id]) // block_size
            hashes, parent = [], b""
            for j in range(num_full):
                parent = hash_block_tokens(parent, kv._block_tokens(seq, j))
                hashes.append(parent)
            registered = [kv.allocator.block_hashes[b] for b in seq.block_table]
            assert registered == hashes + [None] * (len(registered) - num_full), seq
            num_checked += num_full
    assert num_checked > 0 and kv.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_are_registered_only_when_scheduled(tiny_llama_path, async_scheduling):
    """What the CPU pays for prefix caching each step: one registration call per scheduled
    request, from scheduling it; processing a step's output (without drafts) makes none,
    with or without async scheduling."""
    llm = LLM(model=str(tiny_llama_path), async_scheduling=async_scheduling, block_size=4,
              num_kv_blocks=256)  # fmt: skip
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    calls, register = [], kv.cache_full_blocks

    def counted(seq, *args):
        calls.append(seq)
        register(seq, *args)

    kv.cache_full_blocks = counted
    for i, prompt in enumerate(_prompts(6)):
        params = SamplingParams(temperature=0, max_tokens=9 + i, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        calls.clear()
        engine.step()
        assert calls == engine.last_step.scheduled_seqs


def test_stop_strings_and_parallel_sampling_equal(tiny_llama_path):
    """Text stops (found by the output processor, one step late under async scheduling)
    and ``n > 1`` requests whose children share the prompt's blocks."""
    prompts = ["w5 w6 w7", "w1 w2", "w9 w9 w9 w8"]
    _, [probe] = _run_text(tiny_llama_path, prompts[:1], SamplingParams(temperature=0,
                           max_tokens=8, ignore_eos=True))  # fmt: skip
    stop = probe[0][1].split()[2] if len(probe[0][1].split()) > 2 else probe[0][1][:2]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True),
    ]
    _, expected = _run_text(tiny_llama_path, prompts, params, num_kv_blocks=64,
                            async_scheduling=False)  # fmt: skip
    _, got = _run_text(tiny_llama_path, prompts, params, num_kv_blocks=64, async_scheduling=True)
    assert got == expected
    assert expected[0][0][2] == "stop"  # the stop string did fire


def _run_text(path, prompts, params, **options):
    llm = LLM(model=str(path), **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    budget=st.integers(4, 40),
    num_kv_blocks=st.integers(12, 40),
)
def test_any_workload_equal(tiny_llama_path, lengths, max_tokens, budget, num_kv_blocks):
    """Any prompts, budget and pool; a 36-token max_model_len stops some requests there."""
    prompts = [[1] + [(11 * i + 5 * j) % 250 + 3 for j in range(n - 1)] for i, n in
               enumerate(lengths)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    params = params[: len(prompts)]
    options = dict(block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=36,
                   max_num_batched_tokens=budget)  # fmt: skip
    _, expected = _run(tiny_llama_path, prompts, params, async_scheduling=False, **options)
    _, got = _run(tiny_llama_path, prompts, params, async_scheduling=True, **options)
    assert got == expected


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(scheduling_policy="static", enable_prefix_caching=False), "continuous"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
         "speculative"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(async_scheduling="yes"), "True, False or None"),
    ],
)  # fmt: skip
def test_refused_where_not_supported(options, message):
    options.setdefault("async_scheduling", True)
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


UNSUPPORTED = {
    "static": (dict(scheduling_policy="static"), "continuous scheduling policy"),
    "speculative": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                    "speculative decoding"),
    "tensor_parallel": (dict(tensor_parallel_size=2), "tensor_parallel_size=1"),
    "numba_cuda": (dict(attention_backend="numba-cuda"), "numba-cuda"),
}  # fmt: skip


def test_on_by_default_on_cuda_only_and_what_is_asked_wins(monkeypatch):
    """Overlap pays where the model runs on a device: by default on CUDA, off on a CPU
    (the model's work is the CPU's); asked for explicitly, it runs anywhere supported."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the settings only
    cpu = EngineConfig(device="cpu")
    assert cpu.async_scheduling is None  # what was asked: nothing
    assert cpu.async_scheduling_unsupported is None and not cpu.use_async_scheduling
    assert cpu.async_scheduling_off == "the model runs on cpu: nothing to overlap with"
    assert cpu.scheduler_cls == "minivllm.scheduler.Scheduler"
    asked = EngineConfig(device="cpu", async_scheduling=True)
    assert asked.use_async_scheduling
    assert asked.scheduler_cls == "minivllm.async_scheduler.AsyncScheduler"
    cuda = EngineConfig(device="cuda")
    assert cuda.use_async_scheduling and cuda.async_scheduling_off is None
    assert cuda.scheduler_cls == "minivllm.async_scheduler.AsyncScheduler"
    assert not EngineConfig(device="cuda", async_scheduling=False).use_async_scheduling
    spec = EngineConfig(device="cuda", speculative_config={"num_speculative_tokens": 2})
    assert spec.scheduler_cls == "minivllm.spec_decode.scheduler.SpecDecodeScheduler"


def test_a_cpu_engine_steps_synchronously_by_default_and_logs_why(tiny_llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.engine"):
        llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64, device="cpu")
    engine = llm.llm_engine
    assert type(engine.scheduler) is Scheduler and engine.step_fn == engine._step_sync
    assert "async scheduling off: the model runs on cpu: nothing to overlap" in caplog.text


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_default_falls_back_with_the_reason(name):
    options, reason = UNSUPPORTED[name]
    config = EngineConfig(**options)
    assert not config.use_async_scheduling
    assert reason in config.async_scheduling_unsupported
    with pytest.raises(ValueError, match=reason):  # asked for explicitly: refused
        EngineConfig(async_scheduling=True, **options)


def test_static_engine_runs_synchronously_and_logs_why(tiny_llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.engine"):
        llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64, scheduling_policy="static")
    engine = llm.llm_engine
    assert isinstance(engine.scheduler, StaticBatchScheduler)
    assert engine.step_fn == engine._step_sync
    assert "async scheduling off: async_scheduling needs the continuous" in caplog.text


@pytest.mark.slow
def test_smollm2_outputs_equal(smollm2_path):
    """The real model, with chunked prefill and preemption pressure at once."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Continuous batching " * 10,
               "1, 2, 3,", "Write a short poem about the sea."]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    options = dict(num_kv_blocks=20, block_size=8, max_num_batched_tokens=48)
    _, expected = _run_text(smollm2_path, prompts, params, async_scheduling=False, **options)
    llm, got = _run_text(smollm2_path, prompts, params, async_scheduling=True, **options)
    assert isinstance(llm.llm_engine.scheduler, AsyncScheduler)
    assert got == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_logprobs_equal(tiny_llama_path):
    """Sample and prompt logprobs come with the step's output, one step later: the same."""
    prompts = [[1, 5, 9, 13, 17], [1, 7, 7, 7]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.7, seed=5, max_tokens=5, ignore_eos=True,
                             logprobs=0)]  # fmt: skip

    def run(**options):
        llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64, **options)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
        return [(o.outputs[0].token_ids, _logprob_values(o.outputs[0].logprobs),
                 _logprob_values(o.prompt_logprobs)) for o in outputs]  # fmt: skip

    expected = run(async_scheduling=False)
    assert expected[0][1] and expected[0][2]  # there are logprobs to compare
    assert run(async_scheduling=True) == expected


def _logprob_values(rows):
    if rows is None:
        return None
    return [None if r is None else {t: (lp.logprob, lp.rank) for t, lp in r.items()}
            for r in rows]  # fmt: skip
