"""External reference rows: Hugging Face transformers on the same workload.

- ``hf-static``: `generate` on left-padded batches of ``batch_size`` requests in
  workload order, each batch decoding until its longest request is done (exactly what
  the static policy models). A batch's results come back together when it ends.
- ``hf-continuous``: transformers' own continuous batching (the manager behind
  `generate_batch`), with the same cap on requests per batch.

Both are offline only (everything arrives at t=0) and greedy, with the exact output
lengths of the workload. The per-token timestamps make their TTFT / TPOT / ITL comparable
to minivllm's.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from minivllm.bench.metrics import RequestResult, summarize
from minivllm.bench.runner import BenchRun
from minivllm.bench.workloads import Workload
from minivllm.sequence import RequestMetrics
from minivllm.utils import cdiv


def load_hf_model(model_path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


class _StepClock:
    """A stopping criterion that never stops: it notes when each new token exists."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def run_hf_static(model, workload: Workload, batch_size: int, progress: bool = True) -> BenchRun:
    """transformers `generate` on padded static batches; padding is counted like ours."""
    from transformers import StoppingCriteriaList

    pad_id = model.generation_config.pad_token_id or 0
    _hf_generate(model, [workload.requests[0].prompt_token_ids[:32]], 4, pad_id, [])  # warm-up
    results, token_ids = [], {}
    num_real = num_slots = 0
    start = time.perf_counter()
    bar = tqdm(total=len(workload.requests), desc="transformers generate", disable=not progress)
    for i in range(0, len(workload.requests), batch_size):
        batch = workload.requests[i : i + batch_size]
        prompts = [r.prompt_token_ids for r in batch]
        max_new = max(r.max_tokens for r in batch)
        clock = _StepClock()
        first_scheduled = time.perf_counter()
        out = _hf_generate(model, prompts, max_new, pad_id, StoppingCriteriaList([clock]))
        end = time.perf_counter()
        padded_len = max(len(p) for p in prompts)
        # One prefill of batch x padded_len rows, then max_new - 1 decodes of batch rows.
        num_slots += len(batch) * (padded_len + max_new - 1)
        num_real += sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in batch)
        for row, request in enumerate(batch):
            times = clock.times[: request.max_tokens]
            metrics = RequestMetrics(start, first_scheduled, times[0], times, end)
            num_prompt = len(prompts[row])
            results.append(RequestResult(request.request_id, num_prompt, len(times), metrics))
            token_ids[request.request_id] = out[row, padded_len:][: request.max_tokens].tolist()
        bar.update(len(batch))
    bar.close()
    summary = summarize(results, time.perf_counter() - start)
    summary.num_padding_tokens = num_slots - num_real
    summary.padding_waste = (num_slots - num_real) / num_slots
    return BenchRun("hf-static", summary, results, start, output_token_ids=token_ids)


def _hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int, criteria):
    """Left-pad ``prompts`` into one batch and generate exactly ``max_new`` tokens each."""
    padded_len = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (padded_len - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (padded_len - len(p)) + [1] * len(p) for p in prompts])
    return model.generate(
        ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # EOS can't end a row early: every row does the full work
        do_sample=False,
        pad_token_id=pad_id,
        stopping_criteria=criteria,
    )


@torch.inference_mode()
def run_hf_continuous(
    model,
    workload: Workload,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_tokens: int,
    progress: bool = True,
) -> BenchRun:
    """transformers' continuous batching manager with minivllm's limits: at most
    ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens per step, a KV cache of
    ``kv_cache_tokens`` tokens. (Left to itself on a CPU it sizes its cache from 90 % of
    the machine's RAM, which takes many seconds to allocate.)"""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in workload.requests),
        pad_token_id=model.generation_config.pad_token_id or 0,
        eos_token_id=-1,  # never stop early: exact lengths, like ignore_eos
    )
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=max_num_seqs,
        max_batch_tokens=max_num_batched_tokens,
        num_blocks=cdiv(kv_cache_tokens, ContinuousBatchingConfig().page_size),
    )
    # warmup=False: its warm-up captures CUDA graphs (~20 s of nothing on a CPU); our own
    # short warm-up request below builds the batch processor instead, untimed.
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=cb_config, warmup=False
    ) as manager:
        _cb_collect(manager, {"warmup": (workload.requests[0].prompt_token_ids[:32], 4)})
        start = time.perf_counter()
        todo = {r.request_id: (r.prompt_token_ids, r.max_tokens) for r in workload.requests}
        outputs = _cb_collect(manager, todo, progress)
        duration = time.perf_counter() - start
    results, token_ids = [], {}
    for request in workload.requests:
        out = outputs[request.request_id]
        times = out.timestamps
        metrics = RequestMetrics(start, out.lifespan[0], times[0], times, out.lifespan[1])
        num_prompt = len(request.prompt_token_ids)
        results.append(RequestResult(request.request_id, num_prompt, len(times), metrics))
        token_ids[request.request_id] = out.generated_tokens
    summary = summarize(results, duration)
    return BenchRun("hf-continuous", summary, results, start, output_token_ids=token_ids)


def _cb_collect(manager, requests: dict[str, tuple[list[int], int]], progress: bool = False):
    """Submit every request at once and wait until all are done."""
    for request_id, (prompt, max_new) in requests.items():
        manager.add_request(
            prompt, request_id, max_new_tokens=max_new, record_timestamps=True, eos_token_id=-1
        )
    done = {}
    desc = "transformers generate_batch"
    with tqdm(total=len(requests), desc=desc, disable=not progress) as bar:
        while len(done) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
                done[result.request_id] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
    return done
