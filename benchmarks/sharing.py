"""KV blocks saved by sharing them: ``n`` samples of one prompt and beam search, sharing on
and off (PagedAttention, Kwon et al. 2023, section 6.3).

    python benchmarks/sharing.py [--lengths alpaca,sharegpt] [--widths 2,4,6]
                                 [--num-prompts 4] [--modes n,beam] [--json out.json]

Each row runs one seeded workload twice on the same engine, sharing on and off:

- ``n``: ``SamplingParams(n=k)`` per prompt (on: the children share the prompt's full
  blocks) against ``k`` separate requests per prompt with prefix caching off (off: every
  child computes the prompt and holds its own copy of every block);
- ``beam``: beam search of width ``k`` (``BeamSearchParams``) forking by reference count
  with copy-on-write (on) against forking by a copy of every block
  (``share_forked_blocks=False``, off).

Lengths are Alpaca-like (about 19 prompt and 58 output tokens) or ShareGPT-like (about 161
and 338), drawn as in `minivllm.simulator.workloads`; every request of a workload arrives
at once and generates exactly its drawn output length (EOS ignored), in a pool big enough
that nothing is preempted. Per row:

- KV blocks in use after each engine step, averaged over the steps ("mean"; the paper's
  Fig. 15 counts "blocks saved by sharing divided by total blocks without sharing") and
  at the peak; "saved" is ``1 - on / off`` of the mean;
- requests that fit a KV budget (``--budget-blocks``; default: the blocks of the engine's
  default 1 GiB cache), each request counted at its own peak footprint (the distinct
  blocks its samples or beams hold at once): ``budget // mean peak per request``;
- output tokens per CPU second of the whole run, one torch thread, all requests batched
  at once (up to ``num_prompts * k`` sequences a step).

The block columns do not depend on the model for ``n`` (EOS is ignored), nor on the clock.
The default run takes about 6 minutes of CPU time with SmolLM2-135M (``--lengths alpaca``
about 1); the PagedAttention chapter shows its table beside the paper's numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minivllm import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minivllm.bench.workloads import Workload  # noqa: E402
from minivllm.config import DEFAULT_KV_CACHE_BYTES  # noqa: E402
from minivllm.models.arithmetic import num_blocks_for_bytes  # noqa: E402
from minivllm.simulator.workloads import CHAT_LENGTHS, chat_workload  # noqa: E402
from minivllm.utils import cdiv  # noqa: E402

MODES = ("n", "beam")
# The paper's Fig. 15 (OPT-13B), as its section 6.3 states it: memory saved by sharing.
PAPER_SAVING = {
    ("alpaca", "n"): "6.1–9.8 %",
    ("alpaca", "beam"): "37.6–55.2 %",
    ("sharegpt", "n"): "16.2–30.5 %",
    ("sharegpt", "beam"): "44.3–66.3 %",
}


@dataclass
class Run:
    """One workload on one engine, sharing on or off."""

    mean_blocks: float  # KV blocks in use after a step, averaged over the steps
    peak_blocks: int
    request_peak_blocks: float  # each request's most distinct blocks at once, averaged
    num_steps: int
    num_prefill_tokens: int
    num_output_tokens: int  # every sample or beam generates its request's max_tokens
    cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.cpu_s if self.cpu_s else 0.0


@dataclass
class Row:
    lengths: str
    mode: str
    width: int
    num_prompts: int
    budget_blocks: int
    on: Run
    off: Run

    @property
    def saved_mean(self) -> float:
        return 1 - self.on.mean_blocks / self.off.mean_blocks

    @property
    def saved_peak(self) -> float:
        return 1 - self.on.peak_blocks / self.off.peak_blocks

    def batch(self, run: Run) -> int:
        """Requests of this kind that fit the budget, each at its own peak footprint."""
        return int(self.budget_blocks // run.request_peak_blocks)


def group_of(request_id: str) -> str:
    """The prompt a sequence belongs to: ids are ``{i}_{prompt}``, as vLLM names the
    children of an ``n > 1`` request, and as the sharing-off runs name their copies."""
    return request_id.split("_", 1)[1] if "_" in request_id else request_id


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def add_n_requests(engine: LLMEngine, workload: Workload, width: int, sharing: bool) -> None:
    for j, request in enumerate(workload.requests):
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        sample = dict(temperature=0.8, max_tokens=request.max_tokens, ignore_eos=True)
        if sharing:
            engine.add_request(f"p{j}", prompt, SamplingParams(n=width, seed=j * 100, **sample))
        else:  # the same children, as unrelated requests: nobody shares anything
            for i in range(width):
                params = SamplingParams(seed=j * 100 + i, **sample)
                engine.add_request(f"{i}_p{j}", prompt, params)


def add_beam_requests(engine: LLMEngine, workload: Workload, width: int) -> None:
    """Beam search of ``width`` per prompt; whether forks share blocks is the engine's
    ``share_forked_blocks``."""
    from minivllm.sampling_params import BeamSearchParams

    for j, request in enumerate(workload.requests):
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        params = BeamSearchParams(beam_width=width, max_tokens=request.max_tokens, ignore_eos=True)
        engine.add_beam_search_request(f"p{j}", prompt, params)


def measure(engine: LLMEngine, workload: Workload, mode: str, width: int, sharing: bool) -> Run:
    """Run ``workload`` (``n`` samples or beams of ``width`` per prompt) to completion,
    counting the blocks in use after each step. For beams, ``engine`` must be built with
    ``share_forked_blocks=sharing``."""
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "the engine is not idle"
    assert not engine.config.use_async_scheduling, "blocks are counted step by step"
    if mode == "n":
        add_n_requests(engine, workload, width, sharing)
    else:
        assert engine.config.share_forked_blocks == sharing
        add_beam_requests(engine, workload, width)
    used: list[int] = []
    request_peak: dict[str, int] = defaultdict(int)
    prefill = 0
    start = _cpu_s()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_stats
        prefill += stats.num_prefill_tokens
        used.append(stats.num_kv_blocks_used)
        held: dict[str, set[int]] = defaultdict(set)
        for seq in engine.scheduler.running:
            held[group_of(seq.request_id)].update(seq.block_table)
        for group, blocks in held.items():
            request_peak[group] = max(request_peak[group], len(blocks))
    cpu_s = _cpu_s() - start
    assert stats.num_preemptions_total == 0, "the pool was too small"
    return Run(
        mean_blocks=sum(used) / len(used),
        peak_blocks=max(used),
        request_peak_blocks=sum(request_peak.values()) / len(request_peak),
        num_steps=len(used),
        num_prefill_tokens=prefill,
        num_output_tokens=width * workload.num_output_tokens,
        cpu_s=cpu_s,
    )


def blocks_needed(workload: Workload, width: int, block_size: int) -> int:
    """Blocks for every sample of every request at once, nothing shared: a pool this big
    never preempts."""
    return sum(
        width * cdiv(len(r.prompt_token_ids) + r.max_tokens, block_size) for r in workload.requests
    )


def default_budget(engine: LLMEngine) -> int:
    """Blocks of the engine's default cache (1 GiB) for this model."""
    c = engine.config
    return num_blocks_for_bytes(
        engine.model_config, c.block_size, c.torch_dtype, DEFAULT_KV_CACHE_BYTES
    )


def run_rows(
    model: str | None,
    lengths: list[str],
    modes: list[str],
    widths: list[int],
    num_prompts: int,
    seed: int = 0,
    budget_blocks: int | None = None,
    block_size: int = 16,
    progress: bool = True,
) -> list[Row]:
    workloads = {name: chat_workload(num_prompts, name, seed=seed) for name in lengths}
    num_blocks = max(blocks_needed(w, k, block_size) for w in workloads.values() for k in widths)
    max_len = max(len(r.prompt_token_ids) + r.max_tokens for w in workloads.values()
                  for r in w.requests)  # fmt: skip
    options = dict(
        model=model,
        block_size=block_size,
        num_kv_blocks=num_blocks + 1,
        max_num_seqs=max(64, num_prompts * max(widths)),
        max_model_len=max(max_len, 64),
        enable_prefix_caching=False,  # only the sharing under test
        async_scheduling=False,  # blocks are counted after each step's own record
        seed=seed,
    )
    engines = {True: LLMEngine(EngineConfig(**options))}  # sharing on, and off:
    if "beam" in modes:  # beams fork by copying every block
        engines[False] = LLMEngine(EngineConfig(**options, share_forked_blocks=False))
    else:
        engines[False] = engines[True]  # n off is separate requests: no fork to copy
    budget = budget_blocks or default_budget(engines[True])
    first = next(iter(workloads.values())).requests[0]
    for engine in set(engines.values()):  # first-call costs, not timed
        measure(engine, Workload("warm-up", [first]), "n", 1, True)
    rows = []
    for name, workload in workloads.items():
        if progress:
            print(workload.describe(), file=sys.stderr)
        for mode in modes:
            for width in widths:
                on, off = (measure(engines[s], workload, mode, width, s) for s in (True, False))
                rows.append(Row(name, mode, width, num_prompts, budget, on, off))
                if progress:
                    print(f"  {mode} = {width}: saved {rows[-1].saved_mean:.1%}", file=sys.stderr)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| lengths | sharing | k | mean KV blocks, on / off | saved | peak, on / off | saved "
        "| requests in budget, on / off | tokens/s, on / off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        what = "n samples" if r.mode == "n" else "beam width"
        lines.append(
            f"| {r.lengths} | {what} | {r.width} | {r.on.mean_blocks:.1f} / "
            f"{r.off.mean_blocks:.1f} | {r.saved_mean:.1%} | {r.on.peak_blocks} / "
            f"{r.off.peak_blocks} | {r.saved_peak:.1%} | {r.batch(r.on)} / {r.batch(r.off)} "
            f"| {r.on.tokens_per_s:.0f} / {r.off.tokens_per_s:.0f} |"
        )
    return "\n".join(lines).replace("%", " %")


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--lengths", default="alpaca,sharegpt", help="alpaca and/or sharegpt")
    parser.add_argument("--modes", default="n,beam", help="n and/or beam")
    parser.add_argument("--widths", default="2,4,6", help="n and beam widths")
    parser.add_argument("--num-prompts", type=int, default=3, help="prompts per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--budget-blocks", type=int, default=None, help="KV budget (default: the 1 GiB cache)"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    lengths, modes = parse_list(args.lengths), parse_list(args.modes)
    widths = [int(w) for w in parse_list(args.widths)]
    for name in lengths:
        if name not in CHAT_LENGTHS:
            parser.error(f"--lengths: unknown {name!r}; choose from {', '.join(CHAT_LENGTHS)}")
    if set(modes) - set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    if not widths or min(widths) < 1 or args.num_prompts < 1:
        parser.error("--widths and --num-prompts must be positive")
    torch.set_num_threads(1)
    rows = run_rows(args.model, lengths, modes, widths, args.num_prompts, args.seed,
                    args.budget_blocks, args.block_size)  # fmt: skip
    print(
        f"{args.num_prompts} prompts per workload (seed {args.seed}), block_size "
        f"{args.block_size}; mean: KV blocks in use after a step, averaged over the steps; "
        f"budget {rows[0].budget_blocks if rows else '-'} blocks; tokens/s: output tokens "
        "per CPU second, one thread, all requests at once"
    )
    print(markdown(rows))
    if args.json:
        records = [
            {
                **asdict(r),
                "saved_mean": r.saved_mean,
                "saved_peak": r.saved_peak,
                "batch_on": r.batch(r.on),
                "batch_off": r.batch(r.off),
            }  # fmt: skip
            for r in rows
        ]
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
