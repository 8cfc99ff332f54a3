"""Tensor parallelism with real worker processes on gloo: the model split across ranks
gives the same greedy tokens as the whole model, token for token, with chunked prefill,
preemption, prefix caching and speculative decoding on; seeded sampling draws the same
tokens too. A worker that dies or raises makes the engine raise within seconds, and no
worker process outlives its engine: closed, garbage-collected, failed or served.

Every test that starts workers checks by pid that none is left. Each start imports torch
in fresh processes (spawn), so these tests are slow on a small machine.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput
from tests.helpers import free_port, wait_until_healthy

# Small pools and budgets, so a short run chunks prompts, preempts and hits the cache.
OPTIONS = dict(
    block_size=4,
    num_kv_blocks=18,
    max_num_seqs=4,
    max_num_batched_tokens=12,
    enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    attention_backend="torch",  # no kernel compile in every worker
)  # fmt: skip
SHARED = [7, 8, 9, 10, 11, 12, 13, 14]  # a prefix of two blocks the prompts share
PROMPTS = [
    {"prompt_token_ids": SHARED + [20, 21, 22, 20, 21]},  # repeats: drafts get proposed
    {"prompt_token_ids": SHARED + [30]},
    {"prompt_token_ids": [40 + i for i in range(17)]},  # several prefill chunks
    {"prompt_token_ids": SHARED + [50, 51, 52]},
]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_all_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """Every one of ``pids`` has exited (and been reaped, or is a zombie about to be)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"worker pid {pid} is still running"
            time.sleep(0.1)


def worker_pids(llm_or_engine) -> list[int]:
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    return engine.executor.worker_pids


@pytest.fixture(scope="module")
def whole_model_outputs(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), **OPTIONS)
    return generate(llm, GREEDY), generate(llm, SEEDED), llm.llm_engine.scheduler.num_preemptions


@pytest.mark.slow  # two worker processes start (~10-40 s)
def test_two_ranks_equal_one_token_for_token_and_gc_leaves_no_process(
    tiny_llama_path, whole_model_outputs
):
    """The tiny Llama (4 heads, 2 KV heads) split across 2 ranks: one KV head each."""
    greedy, seeded, num_preemptions = whole_model_outputs
    assert num_preemptions > 0  # the small pool really preempts
    llm = LLM(str(tiny_llama_path), tensor_parallel_size=2, **OPTIONS)
    pids = worker_pids(llm)
    assert all(psutil.pid_exists(pid) for pid in pids)
    assert generate(llm, GREEDY) == greedy
    assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.num_hit_tokens > 0
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 0
    assert generate(llm, SEEDED) == seeded  # rank 0's generators advance as the engine's
    del llm  # no close(): garbage collection stops the workers
    gc.collect()
    assert_all_gone(pids)


@pytest.mark.slow
def test_a_killed_worker_makes_the_step_raise_within_seconds(tiny_llama_path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), tensor_parallel_size=2, **OPTIONS))
    pids = worker_pids(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker 1 \(pid {pids[1]}\) .*(died|closed)"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    assert_all_gone(pids)


@pytest.mark.slow
def test_a_worker_that_raises_mid_step_is_reported_and_all_stop(tiny_llama_path):
    """A block id past the cache's end: the workers' indexing fails, and the engine gets
    the worker's traceback instead of a hang."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), tensor_parallel_size=2, **OPTIONS))
    pids = worker_pids(engine)
    bad = ScheduledChunk("r", [5, 6], 0, block_table=[10**6], sample=True,
                         sampling_params=GREEDY)  # fmt: skip
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="raised while running a step:(.|\n)*Error"):
        engine.executor.execute_model(SchedulerOutput(chunks=[bad]))
    assert time.monotonic() - start < 10
    assert_all_gone(pids)


def test_bad_splits_are_refused_before_any_process_starts(tiny_llama_path, monkeypatch):
    with pytest.raises(ValueError, match="4 attention heads must be divisible by "
                       "tensor_parallel_size=3; tensor_parallel_size 1, 2, 4 would work "
                       "for this model$"):  # fmt: skip
        LLM(str(tiny_llama_path), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tensor_parallel_size=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices, torch "
                       "sees 1"):  # fmt: skip
        EngineConfig(device="cuda", tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_the_bundled_models_refusal_names_the_sizes_that_work(smollm2_path):
    """SmolLM2-135M: 9 heads, 3 KV heads, an MLP of 1,536 (not divisible by 9): the
    `-tp 2` a vLLM user types is refused with the sizes that would work."""
    from minivllm.models.loader import load_model_config
    from minivllm.multiproc_executor import check_split, working_split_sizes

    model_config, _ = load_model_config(smollm2_path)
    assert working_split_sizes(model_config) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2; tensor_parallel_size 1, 3 "):
        check_split(model_config, 2)
    with pytest.raises(ValueError, match=r"intermediate_size=1536 must be divisible by "
                       r"tensor_parallel_size=9; tensor_parallel_size 1, 3 "):  # fmt: skip
        check_split(model_config, 9)


@pytest.mark.slow  # SmolLM2 on three ranks of two cores: about a minute or two
def test_smollm2_on_three_ranks_equals_one(smollm2_path):
    """9 query heads and 3 KV heads: 3 query heads and 1 KV head per rank."""
    options = OPTIONS | dict(num_kv_blocks=16, attention_backend="auto")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    whole = LLM(str(smollm2_path), **options)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]
    assert whole.llm_engine.scheduler.num_preemptions > 0
    split = LLM(str(smollm2_path), tensor_parallel_size=3, **options)
    pids = worker_pids(split)
    try:
        got = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
    finally:
        split.close()
    assert got == expected
    assert_all_gone(pids)
    with pytest.raises(RuntimeError, match="workers are stopped"):
        split.generate(prompts[:1], params, use_tqdm=False)


@pytest.mark.slow  # a server process and its two workers start
def test_server_with_two_ranks_answers_openai_and_ctrl_c_leaves_no_process(tiny_llama_path):
    import openai

    port = free_port()
    command = [sys.executable, "-m", "minivllm.cli", "serve", "--model", str(tiny_llama_path)]
    command += ["--port", str(port), "-tp", "2", "--attention-backend", "torch"]
    command += ["--num-kv-blocks", "64", "--log-level", "warning"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server, timeout_s=180)
        pids = [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        assert len(pids) >= 2  # the two workers (and multiprocessing's helper, if any)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.completions.create(
            model=str(tiny_llama_path), prompt="w1 w2 w3", max_tokens=5, temperature=0
        )
        expected = LLM(str(tiny_llama_path), num_kv_blocks=64).generate(
            "w1 w2 w3", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
        )
        assert reply.choices[0].text == expected[0].outputs[0].text
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends the server
        assert server.wait(timeout=60) == 0
        assert "Traceback" not in server.stdout.read().decode()
    finally:
        if server.poll() is None:
            server.kill()
    assert_all_gone(pids)


def test_the_docs_tp_examples_run_with_the_bundled_model(smollm2_path):
    """Every `-tp N` / `tensor_parallel_size=N` the README and the chapter give for the
    bundled model (not the simulator's, which models other hardware) is a size it splits
    into."""
    import re
    from pathlib import Path

    from minivllm.models.loader import load_model_config
    from minivllm.multiproc_executor import working_split_sizes

    sizes = working_split_sizes(load_model_config(smollm2_path)[0])
    root = Path(__file__).parent.parent
    pages = [root / "README.md", *sorted((root / "docs/tutorial").glob("tensor-parallelism*.md"))]
    found = []
    for page in pages:
        for line in page.read_text().splitlines():
            if "simulate" in line or "--tp " in line:
                continue
            for match in re.finditer(r"(?:-tp |tensor_parallel_size=)(\d+)", line):
                found.append((page.name, int(match.group(1))))
    assert len(found) >= 5, found
    assert [f for f in found if f[1] not in sizes] == []


SCRIPT = """\
from minivllm import LLM

def build():
    return LLM({path!r}, tensor_parallel_size=2, attention_backend="torch")

{call}
"""


@pytest.mark.parametrize("call", ["llm = build()", "if True:\n    llm = build()"])
def test_a_script_without_a_main_guard_is_told_in_one_line(tiny_llama_path, tmp_path, call):
    """Workers spawn and import the script again: a script that starts them at top level
    is refused before any process starts, in one line naming the fix (it used to print a
    page of multiprocessing traceback per worker)."""
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT.format(path=str(tiny_llama_path), call=call))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {script}:") and 'if __name__ == "__main__":' in last
    assert len(done.stderr.splitlines()) < 40, done.stderr  # one traceback, not one per worker
    assert "bootstrapping" not in done.stderr


def test_the_main_guard_check_reads_the_script():
    from minivllm.multiproc_executor import unguarded_line

    source = (
        "import x\n"  # 1
        "llm = x.LLM()\n"  # 2
        "def f():\n"  # 3
        "    return x.LLM()\n"  # 4
        "if __name__ == '__main__':\n"  # 5
        "    f()\n"  # 6
        "else:\n"  # 7
        "    f()\n"  # 8
        "if '__main__' == __name__:\n"  # 9
        "    f()\n"  # 10
        "if __name__ != '__main__':\n"  # 11
        "    f()\n"  # 12
    )
    assert [unguarded_line(source, n) for n in (2, 4, 6, 8, 10, 12)] == [2, None, None, 8, None, 12]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_answers_a_step_with_an_error_fails_it_even_when_the_others_replied(
    failing_rank,
):
    """The executor's side of a step, with stand-in workers (sleeping processes whose
    pipes the test answers for them): every other rank replies, one rank answers with its
    exception. The step fails naming that rank, its pid and its traceback, and every
    worker is stopped."""
    import multiprocessing as mp
    import weakref

    from minivllm.multiproc_executor import MultiprocExecutor, WorkerHandle, stop_workers
    from minivllm.worker import WorkerError, WorkerReply

    context = mp.get_context("spawn")
    workers, worker_ends = [], []
    for rank in range(3):
        engine_end, worker_end = context.Pipe()
        process = context.Process(target=time.sleep, args=(60,), daemon=True)
        process.start()
        workers.append(WorkerHandle(rank, process, engine_end))
        worker_ends.append(worker_end)
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.workers = workers
    executor._finalizer = weakref.finalize(executor, stop_workers, workers)
    for rank, end in enumerate(worker_ends):  # the others first: they all replied
        if rank != failing_rank:
            end.send(WorkerReply())
    traceback = 'Traceback (most recent call last):\n  File "x.py"\nValueError: boom'
    worker_ends[failing_rank].send(WorkerError(failing_rank, traceback))
    pid = workers[failing_rank].process.pid
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        executor._receive(30, "running a step")
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert message.startswith(
        f"tensor-parallel worker {failing_rank} (pid {pid}) raised while running a step:\n"
    )
    assert traceback in message and message.endswith("all 3 workers were stopped")
    assert_all_gone([w.process.pid for w in workers])
    assert not executor._finalizer.alive
