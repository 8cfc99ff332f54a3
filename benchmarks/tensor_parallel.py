"""Where a tensor-parallel step's time goes: compute, all-reduce, and sending the inputs.

    python benchmarks/tensor_parallel.py [--tp 1 2 3] [--batch 8] [--prompt-len 64]
        [--decode-steps 16] [--prefill-tokens 256]

A model of SmolLM2-135M's sizes (30 layers, hidden 576, intermediate 1536, vocabulary
49152) with random weights and 12 query / 6 KV heads of 48 dimensions instead of 9 / 3
of 64, so that both 2 and 3 ranks can split it (``--model`` takes a real checkpoint), on
this CPU, for each tensor-parallel size: the median
decode step (``--batch`` sequences, one token each: memory-bound) and the median prefill
step (``--prefill-tokens`` prompt tokens in one step: compute-bound), split as rank 0 sees
it into *compute* (its slice of the matmuls and attention), *all-reduce* (the 2 per layer
plus the embedding's, and the logits gather: waiting for the slowest rank included) and
*transfer* (pickling the step's chunks, the pipes to every worker and back, waking them).
``1 (in-process)`` is the ordinary engine with one torch thread; ``1 (one worker)`` is the
same model behind `MultiprocExecutor` with one rank: its transfer column is the price of
the process boundary alone. Each worker runs one torch thread.

It also prints the bytes behind the numbers: the payload each worker receives per step and
the bytes each rank all-reduces per step (``(2 * layers + 1) * tokens * hidden * 4``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.executor import UniProcExecutor
from minivllm.model_info import ModelInfo
from minivllm.models.model_files import resolve_model_path
from minivllm.multiproc_executor import MultiprocExecutor, StepTiming


def smollm2_sized_checkpoint(path: Path) -> str:
    """Random weights, SmolLM2-135M's sizes, heads that 1, 2 and 3 ranks all divide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").is_file():
        config = LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=8192,
            tie_word_embeddings=True, rope_theta=100000.0,
        )  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def timed_in_process(executor: UniProcExecutor) -> list[StepTiming]:
    """Wrap ``execute_model`` so the in-process engine reports timings like the workers."""
    timings: list[StepTiming] = []
    execute = executor.execute_model

    def execute_and_time(scheduler_output):
        start = time.perf_counter()
        output = execute(scheduler_output)
        seconds = time.perf_counter() - start
        timings.append(StepTiming(seconds, seconds, 0.0, 0))
        return output

    executor.execute_model = execute_and_time
    return timings


def make_engine(args, tp: int, in_process: bool) -> tuple[LLMEngine, list[StepTiming]]:
    config = EngineConfig(
        model=args.model, tensor_parallel_size=tp, max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.prefill_tokens, args.batch),
        num_kv_blocks=args.num_kv_blocks,
    )  # fmt: skip
    model_info = ModelInfo.load(resolve_model_path(args.model))
    if in_process:
        executor = UniProcExecutor(config, model_info.eos_token_ids)
        timings = timed_in_process(executor)
    else:
        executor = MultiprocExecutor(config, model_info.eos_token_ids)
        timings = []
    return LLMEngine(config, executor=executor, model_info=model_info), timings


def run_steps(engine: LLMEngine, timings: list[StepTiming], prompts, max_tokens: int):
    """Run ``prompts`` to the end; the timing of each step, and whether it was decode."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        timing = timings[-1] if timings else engine.executor.last_step_timing
        steps.append((timing, engine.last_step.num_prefill_tokens == 0))
    return steps


def median_timing(timings: list[StepTiming]) -> StepTiming:
    pick = lambda f: statistics.median(f(t) for t in timings)  # noqa: E731
    return StepTiming(
        pick(lambda t: t.total_seconds), pick(lambda t: t.execute_seconds),
        pick(lambda t: t.comm_seconds), int(pick(lambda t: t.payload_bytes)),
    )  # fmt: skip


def measure(args, tp: int, in_process: bool) -> dict[str, StepTiming]:
    engine, timings = make_engine(args, tp, in_process)
    try:
        # Prefill: prompts that fill one step's budget; only full-prefill steps count.
        num_prompts = max(1, args.prefill_tokens // args.prompt_len)
        prompts = [[100 + (7 * i + j) % 4000 for j in range(args.prompt_len)]
                   for i in range(num_prompts)]  # fmt: skip
        prefill = []
        for _ in range(args.repeats):
            engine.reset_prefix_cache()
            steps = run_steps(engine, timings, prompts, max_tokens=1)
            prefill += [t for t, is_decode in steps if not is_decode]
        # Decode: a batch of short prompts, then the steady decode steps.
        prompts = [[200 + (11 * i + j) % 4000 for j in range(args.prompt_len)]
                   for i in range(args.batch)]  # fmt: skip
        steps = run_steps(engine, timings, prompts, max_tokens=args.decode_steps + 2)
        decode = [t for t, is_decode in steps if is_decode][2:]  # skip the first, warming
        return {"decode": median_timing(decode), "prefill": median_timing(prefill)}
    finally:
        engine.close()


def all_reduce_bytes(model_config, num_tokens: int) -> int:
    """Bytes one rank contributes to all-reduces in one step (fp32 hidden states)."""
    return (2 * model_config.num_layers + 1) * num_tokens * model_config.hidden_size * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: random, SmolLM2-sized")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the in-process engine gets what one worker gets
    if args.model is None:
        args.model = smollm2_sized_checkpoint(Path(tempfile.gettempdir()) / "tp-bench-model")

    model_config = ModelInfo.load(resolve_model_path(args.model)).model_config
    runs = [("1 (in-process)", 1, True)] if 1 in args.tp else []
    runs += [(f"{tp}" if tp > 1 else "1 (one worker)", tp, False) for tp in args.tp]
    print(f"{model_config.num_layers} layers, hidden {model_config.hidden_size}, "
          f"{model_config.num_heads} / {model_config.num_kv_heads} heads; "
          f"{torch.get_num_threads()} torch thread per process; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    header = "| tp | step | total ms | compute ms | all-reduce ms | transfer ms | payload B |"
    print(header + " all-reduce B/rank |")
    print("|" + " --- |" * 8)
    for label, tp, in_process in runs:
        results = measure(args, tp, in_process)
        for regime, t in results.items():
            tokens = args.batch if regime == "decode" else args.prefill_tokens
            reduced = all_reduce_bytes(model_config, tokens) if tp > 1 else 0
            print(
                f"| {label} | {regime} ({tokens} tok) | {t.total_seconds * 1e3:.1f} | "
                f"{t.compute_seconds * 1e3:.1f} | {t.comm_seconds * 1e3:.1f} | "
                f"{t.transfer_seconds * 1e3:.2f} | {t.payload_bytes} | {reduced} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
