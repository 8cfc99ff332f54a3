"""The code a learner reads to follow one plain decode step, in the order it runs.

One running request, greedy, synchronous scheduling (the default on a CPU), the torch
attention backend, ``FINAL_ONLY`` outputs: each function or class on that path, with its
lines (docstrings and comments included, as a reader meets them), and the total. Also the
hub files' sizes. docs/architecture.md shows the table; run it again after a change:

    python benchmarks/reading_path.py            # the table and the total
    python benchmarks/reading_path.py --markdown # the same as a Markdown table
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minivllm"

# (file, the functions and classes a reader opens there), in the order the step runs.
PATH: list[tuple[str, list[str]]] = [
    ("llm.py", ["LLM._run_engine"]),
    ("engine.py", ["LLMEngine.step", "LLMEngine._step_sync", "LLMEngine._process_output"]),
    ("scheduler.py", [
        "Scheduler.schedule", "Scheduler._schedule_running", "Scheduler._schedule_waiting",
        "Scheduler._add_to_step", "Scheduler._schedule_leftover",
        "Scheduler.update_from_output", "Scheduler.finish_requests",
    ]),
    ("kv_cache_manager.py", [
        "KVCacheManager.allocate_slots", "KVCacheManager.cache_full_blocks",
        "KVCacheManager.free",
    ]),
    ("block_allocator.py", ["BlockAllocator.allocate", "BlockAllocator.free"]),
    ("scheduler_output.py", ["ScheduledChunk", "SchedulerOutput", "SchedulerOutput.add"]),
    ("sequence.py", ["Sequence"]),
    ("executor.py", ["UniProcExecutor.execute_model"]),
    ("model_runner.py", [
        "ModelRunner.execute_model", "ModelRunner._fill_placeholders",
        "ModelRunner._execute_model", "ModelRunner._sample",
    ]),
    ("input_batch.py", ["InputBatch.prepare", "InputBatch._update_row"]),
    ("attention/backend.py", ["AttentionMetadata", "write_kv_cache"]),
    ("attention/torch_backend.py", ["TorchAttentionBackend", "_causal_attention"]),
    ("models/llama.py", [
        "RMSNorm", "RotaryEmbedding", "apply_rotary", "Attention", "MLP", "DecoderLayer",
        "CausalLM.forward", "CausalLM.compute_logits",
    ]),
    ("sampler.py", ["Sampler"]),
    ("output_processor.py", [
        "OutputProcessor.process", "OutputProcessor.append_tokens",
        "OutputProcessor._check_stop", "OutputProcessor.make_output",
    ]),
    ("detokenizer.py", ["Detokenizer.update", "Detokenizer._decode_next"]),
    ("request_groups.py", ["RequestGroupSet.consume", "RequestGroupSet.after_step"]),
    ("stats.py", ["TokenCounts", "EngineStats.step_done", "EngineStats.make_stats",
                  "StepStats.capture"]),
]  # fmt: skip

HUBS = [
    "engine.py", "scheduler.py", "kv_cache_manager.py", "model_runner.py",
    "scheduler_output.py", "executor.py",
]  # fmt: skip


def spans(path: Path) -> dict[str, int]:
    """Every top-level function and class, and every method as ``Class.name``: its lines."""
    result = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            result[node.name] = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    result[f"{node.name}.{item.name}"] = item.end_lineno - item.lineno + 1
    return result


def measure() -> list[tuple[str, str, int]]:
    """(file, name, lines) for every step on the path; a name that no longer exists fails."""
    rows = []
    for file, names in PATH:
        found = spans(PACKAGE / file)
        for name in names:
            if name not in found:
                raise SystemExit(f"{file}: no {name} (renamed? update PATH)")
            # A method counted inside its class already is not counted again.
            if "." in name and name.split(".")[0] in names:
                continue
            rows.append((file, name, found[name]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    rows = measure()
    by_file: dict[str, list[tuple[str, int]]] = {}
    for file, name, lines in rows:
        by_file.setdefault(file, []).append((name, lines))
    if args.markdown:
        print("| # | file | functions and classes, in order | lines |")
        print("| --- | --- | --- | --- |")
    for i, (file, items) in enumerate(by_file.items(), start=1):
        names = ", ".join(f"`{n}`" for n, _ in items)
        total = sum(lines for _, lines in items)
        if args.markdown:
            print(f"| {i} | `{file}` | {names} | {total} |")
        else:
            print(f"{i:2} {file:28} {total:4}  {names}")
    total = sum(lines for _, _, lines in rows)
    print(f"\nreading path: {total} lines in {len(by_file)} files")
    hubs = {f: len((PACKAGE / f).read_text().splitlines()) for f in HUBS}
    print("hub files: " + ", ".join(f"{f} {n}" for f, n in hubs.items()))


if __name__ == "__main__":
    main()
