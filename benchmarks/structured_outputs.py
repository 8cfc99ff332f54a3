"""What structured outputs cost inside the batch: 32 requests, half of them constrained
to JSON schemas, against the same 32 with no constraint.

    python benchmarks/structured_outputs.py [--num-requests 32] [--output-len 64]
                                            [--repeats 2] [--json out.json]

Both batches run on one engine (SmolLM2-135M-Instruct, one torch thread, synchronous
steps), alternately, ``--repeats`` times each. Every request generates exactly
``--output-len`` tokens: the free ones ignore EOS, the constrained ones follow schemas
whose shortest instance is longer than that (an array with ``minItems``), so both batches
compute the same number of tokens and the throughput ratio is a ratio of times. Half the
constrained requests share one of four schemas (four compiles, the rest cache hits).

Printed: output tokens per second (wall) and per CPU second for each batch and their
ratio; the engine's CPU time per step, and of it the three structured-output parts:
filling the bitmask rows (the matchers, `StructuredOutputManager.grammar_bitmask`),
applying them to the logits (`apply_grammar_bitmask`, timed by wrapping it here), and
advancing the matchers by the sampled tokens; compile time per schema and cache hits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import minivllm.model_runner as model_runner  # noqa: E402
from minivllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minivllm import StructuredOutputsParams as SO  # noqa: E402
from minivllm.models.model_files import default_model_path  # noqa: E402


def schemas(min_items: int) -> list[dict]:
    """Four schemas whose every instance is an array of at least ``min_items`` records."""
    record = [
        {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string",
         "maxLength": 12}},
        {"city": {"type": "string", "maxLength": 10}, "temp": {"type": "number"}},
        {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string",
         "maxLength": 5}, "maxItems": 3}},
        {"level": {"enum": ["low", "mid", "high"]}, "count": {"type": "integer"}},
    ]  # fmt: skip
    return [
        {
            "type": "array",
            "minItems": min_items,
            "items": {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            },  # fmt: skip
        }
        for props in record
    ]


PROMPT = "List records as JSON. Record {i}:"


def run(engine: LLMEngine, num_requests: int, output_len: int, constrained: bool, tag: str):
    """One batch, all requests at once; returns wall seconds, CPU seconds, steps."""
    kinds = schemas(min_items=output_len)
    for i in range(num_requests):
        structured = None
        if constrained and i % 2 == 0:
            structured = SO(json=kinds[(i // 2) % len(kinds)])
        params = SamplingParams(
            max_tokens=output_len, temperature=0, ignore_eos=structured is None,
            structured_outputs=structured,
        )  # fmt: skip
        engine.add_request(f"{tag}-{i}", PROMPT.format(i=i), params)
    steps, tokens = 0, 0
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        steps += 1
    return time.perf_counter() - wall, time.process_time() - cpu, steps, tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    apply_s = [0.0]
    original_apply = model_runner.apply_grammar_bitmask

    def timed_apply(*a):
        start = time.thread_time()
        out = original_apply(*a)
        apply_s[0] += time.thread_time() - start
        return out

    model_runner.apply_grammar_bitmask = timed_apply
    try:
        return _measure(args, apply_s)
    finally:
        model_runner.apply_grammar_bitmask = original_apply


def _measure(args: argparse.Namespace, apply_s: list[float]) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=args.model or str(default_model_path()),
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=2048,
            async_scheduling=False,
        )  # fmt: skip
    )
    run(engine, 4, 4, constrained=True, tag="warmup")  # loads the grammar tokenizer too
    stats = engine.structured_output.stats
    stats.mask_fill_s = stats.advance_s = 0.0
    apply_s[0] = 0.0
    compiles_before, hits_before = stats.num_compiles, stats.num_cache_hits
    compile_times_before = len(stats.compile_s)

    runs = {"free": [], "constrained": []}
    for r in range(args.repeats):
        for mode in ("free", "constrained"):
            result = run(engine, args.num_requests, args.output_len, mode == "constrained",
                         f"{mode}-{r}")  # fmt: skip
            runs[mode].append(result)

    def total(mode, i):
        return sum(x[i] for x in runs[mode])

    free_wall, con_wall = total("free", 0), total("constrained", 0)
    free_cpu, con_cpu = total("free", 1), total("constrained", 1)
    tokens = {m: total(m, 3) for m in runs}
    con_steps = total("constrained", 2)
    result = {
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "tokens": tokens,
        "free_tok_per_s": tokens["free"] / free_wall,
        "constrained_tok_per_s": tokens["constrained"] / con_wall,
        "throughput_ratio_wall": (tokens["constrained"] / con_wall) / (tokens["free"] / free_wall),
        "throughput_ratio_cpu": (tokens["constrained"] / con_cpu) / (tokens["free"] / free_cpu),
        "cpu_ms_per_step_free": 1e3 * free_cpu / total("free", 2),
        "cpu_ms_per_step_constrained": 1e3 * con_cpu / con_steps,
        "mask_fill_ms_per_step": 1e3 * stats.mask_fill_s / con_steps,
        "mask_apply_ms_per_step": 1e3 * apply_s[0] / con_steps,
        "advance_ms_per_step": 1e3 * stats.advance_s / con_steps,
        "masked_rows_per_step": stats.num_masked_rows / con_steps,
        "compile_ms": [round(1e3 * s, 2) for s in stats.compile_s[compile_times_before:]],
        "compile_ms_warmup": [round(1e3 * s, 2) for s in stats.compile_s[:compile_times_before]],
        "num_compiles": stats.num_compiles - compiles_before,
        "num_cache_hits": stats.num_cache_hits - hits_before,
    }
    engine.close()
    print(
        f"{args.num_requests} requests x {args.output_len} tokens, {args.repeats} runs each "
        f"(half constrained vs none)\n"
        f"  free:        {result['free_tok_per_s']:.1f} tok/s, "
        f"{result['cpu_ms_per_step_free']:.2f} CPU ms/step\n"
        f"  constrained: {result['constrained_tok_per_s']:.1f} tok/s, "
        f"{result['cpu_ms_per_step_constrained']:.2f} CPU ms/step\n"
        f"  throughput ratio: {result['throughput_ratio_wall']:.3f} (wall), "
        f"{result['throughput_ratio_cpu']:.3f} (CPU)\n"
        f"  per step: mask fill {result['mask_fill_ms_per_step']:.3f} ms, apply "
        f"{result['mask_apply_ms_per_step']:.3f} ms, advance "
        f"{result['advance_ms_per_step']:.3f} ms ({result['masked_rows_per_step']:.1f} rows)\n"
        f"  compiles: {result['num_compiles']} ({result['compile_ms']} ms; warm-up's "
        f"{result['compile_ms_warmup']} ms), "
        f"cache hits: {result['num_cache_hits']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
