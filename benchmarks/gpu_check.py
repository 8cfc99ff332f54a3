"""Everything that needs a real GPU, in one run of under 5 minutes: `make gpu-check`.

1. the kernel property and end-to-end tests against the real numba.cuda kernel
   (``MINIVLLM_REAL_GPU=1 pytest tests/test_kernels.py tests/test_kernels_e2e.py``);
2. SmolLM2-135M greedy parity on the GPU: ``attention_backend="numba-cuda"`` against
   ``"torch"``, token for token in fp32 (fp16 agreement is printed, not required);
3. a micro-benchmark of the kernel against torch on decode batches (32 and 256
   sequences, contexts up to 2048), with the memory bandwidth each achieves;
4. with two or more GPUs, tensor parallelism over NCCL: ``tensor_parallel_size=2`` gives
   ``tensor_parallel_size=1``'s greedy tokens (skipped, and said so, on one GPU).

Run it from the repository root (step 1 needs ``tests/``). Exits non-zero if a step fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from minivllm_kernels.random_batch import HEAD_DIM, NUM_KV_HEADS, random_paged_step

from minivllm.attention import get_backend
from minivllm.utils import cdiv

REPO = Path(__file__).resolve().parents[1]
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Continuous batching lets a server",
    "Write a haiku about paging.",
    "Name three prime numbers.",
    "Once upon a time, in a small village by the sea,",
]


def run_kernel_tests() -> None:
    """Step 1: the CPU test suite's kernel tests, with numba.cuda on the GPU."""
    tests = ["tests/test_kernels.py", "tests/test_kernels_e2e.py"]
    env = {**os.environ, "MINIVLLM_REAL_GPU": "1"}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", *tests]
    subprocess.run(command, cwd=REPO, env=env, check=True)


def greedy_token_ids(
    backend: str, dtype: str, device: str, model: str | None, prompts: list[str], max_tokens: int
) -> list[list[int]]:
    from minivllm import LLM, SamplingParams

    llm = LLM(model=model, attention_backend=backend, dtype=dtype, device=device, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def check_smollm2_parity(
    device: str = "cuda",
    model: str | None = None,
    prompts: list[str] = PARITY_PROMPTS,
    max_tokens: int = 32,
) -> None:
    """Step 2: numba-cuda and torch generate the same greedy tokens (``model=None``:
    SmolLM2-135M-Instruct)."""
    expected = greedy_token_ids("torch", "float32", device, model, prompts, max_tokens)
    got = greedy_token_ids("numba-cuda", "float32", device, model, prompts, max_tokens)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, f"fp32 prompt {i}: numba-cuda {a} != torch {b}"
    print(f"fp32: numba-cuda == torch on {len(expected)} prompts x {max_tokens} tokens")
    expected = greedy_token_ids("torch", "float16", device, model, prompts, max_tokens)
    got = greedy_token_ids("numba-cuda", "float16", device, model, prompts, max_tokens)
    same = sum(_common_prefix(a, b) for a, b in zip(got, expected))
    total = sum(len(ids) for ids in expected)
    print(f"fp16: {same}/{total} tokens equal before the first divergence (informational)")


def check_tensor_parallel_parity(max_tokens: int = 16) -> None:
    """Step 4: two ranks over NCCL, one per GPU, equal one rank token for token, on the
    tests' tiny random Llama (its heads split in two; SmolLM2's 9 do not)."""
    if torch.cuda.device_count() < 2:
        print(f"skipped: {torch.cuda.device_count()} CUDA device, tensor parallelism needs 2")
        return
    import tempfile

    sys.path.insert(0, str(REPO))  # tests/helpers.py builds the checkpoint
    from minivllm import LLM, SamplingParams
    from tests.helpers import make_tiny_checkpoint

    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()), "llama")
    prompts = ["w1 w2 w3", "w10 w20 w30 w40 w50", "w7", "w100 w101 w102 w103"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, device="cuda", dtype="float32",
                  attention_backend="torch", num_kv_blocks=256)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[tp] = [output.outputs[0].token_ids for output in outputs]
        llm.close()
    assert results[1] == results[2], f"tp=2 {results[2]} != tp=1 {results[1]}"
    print(f"tp=2 == tp=1 on {len(prompts)} prompts x {max_tokens} tokens (NCCL, 2 GPUs)")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def padded_sdpa_decode(query, key_cache, value_cache, metadata, scale):
    """torch's best batched path: gather every context into ``[seqs, kv_heads, L, dim]``
    (padded to the longest), mask the padding, one SDPA call with GQA."""
    max_blocks = cdiv(metadata.max_context_len, key_cache.shape[1])
    tables = metadata.block_tables[:, :max_blocks].long()
    keys = key_cache[tables].flatten(1, 2).transpose(1, 2)  # [seqs, kv_heads, L, dim]
    values = value_cache[tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    visible = positions[None, :] < metadata.context_lens[:, None]  # [seqs, L]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :],
        scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[:, :, 0, :]


def time_ms(fn, device: str, repeats: int) -> float:
    """Median milliseconds per call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return sorted(times)[len(times) // 2]


def benchmark_decode(
    device: str = "cuda",
    cases: dict[str, list[int]] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.float32),
    repeats: int = 20,
) -> list[dict]:
    """Step 3: time per decode call and achieved K/V read bandwidth, per path."""
    if cases is None:
        generator = torch.Generator().manual_seed(0)
        cases = {
            "32 seqs x 2048": [2048] * 32,
            "256 seqs, ctx 1-2048": torch.randint(1, 2049, (256,), generator=generator).tolist(),
        }
    scale = HEAD_DIM**-0.5
    paths = {
        "numba-cuda": get_backend("numba-cuda")().forward,
        "torch SDPA, padded": padded_sdpa_decode,
        "torch reference": get_backend("torch")().forward,
    }
    rows = []
    print(f"{'case':22} {'dtype':8} {'path':20} {'ms':>8} {'GB/s':>8}")
    for case, context_lens in cases.items():
        for dtype in dtypes:
            batch = random_paged_step(context_lens, [1] * len(context_lens), dtype, device)
            element = torch.finfo(dtype).bits // 8
            kv_bytes = 2 * sum(context_lens) * NUM_KV_HEADS * HEAD_DIM * element
            reference = paths["torch reference"](*batch, scale)
            for path, forward in paths.items():
                output = forward(*batch, scale)
                torch.testing.assert_close(output, reference, atol=2e-3, rtol=2e-3)
                ms = time_ms(lambda f=forward, b=batch: f(*b, scale), device, repeats)
                dtype_name = str(dtype).removeprefix("torch.")
                print(f"{case:22} {dtype_name:8} {path:20} {ms:8.3f} {kv_bytes / ms / 1e6:8.1f}")
                rows.append(dict(case=case, dtype=dtype_name, path=path, ms=ms))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU that torch can see (a CUDA build of torch).")
        return 2
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("unset NUMBA_ENABLE_CUDASIM: gpu-check runs the kernel on the real GPU.")
        return 2
    try:
        from numba.cuda.cudadrv.nvvm import NVVM

        NVVM()  # numba compiles kernels with libNVVM, which torch's CUDA wheels lack
    except Exception as error:
        print(f"numba.cuda cannot compile: {error}")
        print('install libNVVM, e.g. pip install "nvidia-nvvm==13.*" "nvidia-cuda-nvrtc==13.*"')
        print("(or the CUDA toolkit) matching the GPU driver's CUDA version")
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    steps = [
        ("kernel tests on the GPU", run_kernel_tests),
        ("SmolLM2 greedy parity, numba-cuda vs torch", check_smollm2_parity),
        ("decode micro-benchmark", benchmark_decode),
        ("tensor parallelism, tp=2 vs tp=1", check_tensor_parallel_parity),
    ]
    failed = []
    for title, step in steps:
        print(f"\n== {title}", flush=True)
        start = time.perf_counter()
        try:
            step()
        except Exception:  # report and go on: one run should show everything it can
            traceback.print_exc()
            failed.append(title)
        print(f"-- {title}: {time.perf_counter() - start:.1f} s", flush=True)
    print("\ngpu-check:", "FAILED: " + ", ".join(failed) if failed else "all steps passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
