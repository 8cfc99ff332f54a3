"""The scheduler's queues, step by step: who waits, who runs, who was preempted, what each
step spent of its token budget, and which KV blocks it allocated and freed.

    python benchmarks/scheduler_queues.py [--steps 16] [--plot scheduler_queues.png]

A deliberately small engine (a 32-token budget, 3 sequences at most, 6 blocks of 16
slots) runs four requests on SmolLM2-135M-Instruct, greedy with EOS ignored, so the
schedule is the same on every machine; a fifth arrives at step 4. Prints one Markdown
table row per step (the table in docs/tutorial/scheduler-queues.md) and draws the queue
lengths and the blocks in use per step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.sequence import SequenceStatus

# (request id, prompt length, output length, step it arrives before)
REQUESTS = [("A", 20, 12, 0), ("B", 40, 8, 0), ("C", 12, 20, 0), ("D", 24, 16, 0)]
REQUESTS += [("E", 8, 4, 4)]


@dataclass
class StepRow:
    step: int
    waiting: list[str]  # front first; a preempted request shows as "id*"
    running: list[str]  # oldest first
    scheduled: dict[str, int]  # request id -> tokens computed this step
    budget_spent: int
    blocks_allocated: int
    blocks_freed: int
    blocks_in_use: int
    preempted: list[str]
    finished: list[str]


def block_counts(engine: LLMEngine) -> dict[str, int]:
    return {rid: len(seq.block_table) for rid, seq in engine.scheduler.requests.items()}


def queue(seqs) -> list[str]:
    return [s.request_id + ("*" if s.status is SequenceStatus.PREEMPTED else "") for s in seqs]


def trace(engine: LLMEngine, num_steps: int) -> list[StepRow]:
    """Run ``num_steps`` steps (or until done), reading the queues after each one."""
    rows = []
    for step in range(num_steps):
        for rid, prompt_len, output_len, arrives in REQUESTS:
            if arrives == step:
                params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
                prompt = {"prompt_token_ids": [100 + i % 100 for i in range(prompt_len)]}
                engine.add_request(rid, prompt, params)
        if not engine.has_unfinished_requests():
            break
        before = block_counts(engine)
        finished = [out.request_id for out in engine.step() if out.finished]
        after = block_counts(engine)
        stats = engine.last_stats
        scheduled = engine.last_step.num_scheduled_tokens
        grown = sum(max(0, after.get(rid, 0) - before.get(rid, 0)) for rid in after)
        shrunk = sum(max(0, n - after.get(rid, 0)) for rid, n in before.items())
        rows.append(
            StepRow(
                step=step,
                waiting=queue(engine.scheduler.waiting),
                running=queue(engine.scheduler.running),
                scheduled=dict(scheduled),
                budget_spent=sum(scheduled.values()),
                # A preempted request that is re-admitted in the same step would show as a
                # net change; the engine never does that (no admission in a preempting step).
                blocks_allocated=grown,
                blocks_freed=shrunk,
                blocks_in_use=stats.num_kv_blocks_used,
                preempted=list(stats.preempted_ids),
                finished=finished,
            )
        )
    return rows


def markdown(rows: list[StepRow], budget: int) -> str:
    lines = [
        "| step | computed this step (tokens) | budget spent | waiting (front first) | "
        "running (oldest first) | blocks +new / −freed → in use | events |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        scheduled = ", ".join(f"{rid} {n}" for rid, n in r.scheduled.items()) or "–"
        events = [f"{rid} preempted" for rid in r.preempted]
        events += [f"{rid} finished" for rid in r.finished]
        lines.append(
            f"| {r.step} | {scheduled} | {r.budget_spent} / {budget} | "
            f"{' '.join(r.waiting) or '–'} | {' '.join(r.running) or '–'} | "
            f"+{r.blocks_allocated} / −{r.blocks_freed} → {r.blocks_in_use} | "
            f"{', '.join(events) or ''} |"
        )
    return "\n".join(lines)


def plot(rows: list[StepRow], num_blocks: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in rows]
    fig, (queues, blocks) = plt.subplots(1, 2, figsize=(10, 3.4), sharex=True)
    queues.step(steps, [len(r.running) for r in rows], where="mid", label="running")
    queues.step(steps, [len(r.waiting) for r in rows], where="mid", label="waiting")
    preempted = [sum(q.endswith("*") for q in r.waiting) for r in rows]
    queues.step(steps, preempted, where="mid", label="of which preempted", linestyle="--")
    queues.set_ylabel("requests (after the step)")
    blocks.bar(steps, [r.blocks_in_use for r in rows], color="#4e79a7", label="blocks in use")
    blocks.axhline(num_blocks, color="black", linewidth=1, label=f"pool ({num_blocks} blocks)")
    blocks.set_ylabel("KV blocks")
    for ax in (queues, blocks):
        ax.set_xlabel("engine step")
        ax.set_xticks(steps)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--plot", default="scheduler_queues.png", help="the figure's path")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=args.model,
        num_kv_blocks=6,
        max_num_batched_tokens=32,
        max_num_seqs=3,
        max_model_len=96,
        attention_backend="torch",
        enable_prefix_caching=False,  # the chapter's preempted request recomputes its tokens
        async_scheduling=False,  # the queues after each step, as that step left them
    )
    rows = trace(LLMEngine(config), args.steps)
    print(markdown(rows, config.max_num_batched_tokens))
    print("wrote", plot(rows, config.num_kv_blocks, Path(args.plot)))


if __name__ == "__main__":
    main()
