"""The engine's own CPU time per step, at GPU scale: does minivllm keep a GPU fed?

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--running 64,256,512,1024]
        [--modes decode,mixed] [--detokenize off,on] [--steps 20]
        [--scheduling sync,async] [--repeats 3] [--profile] [--json PATH] [--plot PATH.svg]
    python benchmarks/overhead.py --from-json PATH --plot PATH.zh.svg --lang zh
    python benchmarks/overhead.py --floor [--running 64,256,512,1024]

The real engine runs: scheduler, KV-cache manager, the model runner's input preparation
(`ModelRunner.prepare_inputs`, on CPU tensors), its sampling bookkeeping, the output
processor and, with ``--detokenize on``, incremental detokenization with SmolLM2's
tokenizer. Only the model is missing: a stand-in computes nothing and "samples" a
deterministic next token, and each step is charged the time the simulator's cost model
gives llama-3.1-8b on one H200 (minivllm/simulator/cost_model.py).

Per step it reports CPU time (user + sys of this process, `time.process_time`, so other
work on a shared machine does not inflate it) split into

- schedule: `Scheduler.schedule` and its bookkeeping after the step (`update_from_output`);
- inputs: `ModelRunner.prepare_inputs` (flat token ids, positions, slot mapping, block
  tables);
- sample: the rest of `ModelRunner.execute_model` (choosing the rows to sample, the
  sampler's per-request bookkeeping, the sampled ids back to Python);
- outputs: appending tokens, stop checks, building each `RequestOutput`;
- detok: the detokenizer's share of that (0 with ``--detokenize off``);

the simulated GPU step (working it out is the simulator's CPU time, not the engine's: it
is left out), and GPU busy % = GPU / (GPU + CPU): without overlap, the GPU
idles while the CPU works between two steps. With ``--scheduling async`` the engine runs
its async path (`AsyncScheduler`, placeholder tokens filled in by the model runner, each
step's output processed one step later), and all of a step's CPU work would overlap the
GPU's previous step, so busy % = GPU / max(GPU, CPU). There is no GPU here to overlap
with, so the step runs inline, where its phases can be timed; the CPU time is measured,
the overlap is the formula. (The engine's worker thread would change nothing measured
here: the executor only moves a simulated clock, it neither sleeps nor spins, and
`time.process_time` counts every thread of the process.)

Workloads, ``N`` requests in flight (``max_num_seqs = N``, an 8,192-token budget):
- decode: ``N`` requests with 256-token prompts, measured once all of them decode;
- mixed: a request that finishes is replaced by a new one at once, so prompts (256
  tokens) are prefilled in the same steps as the others decode; output lengths spread
  over 16-272 tokens.
Every request streams (``RequestOutputKind.DELTA``), as behind a server. Once the engine
is built, the objects alive then are frozen out of the garbage collector's passes, as vLLM
does (`minivllm.utils.freeze_gc_heap`; ``--no-freeze-gc`` to see the difference).

``--repeats N`` measures every configuration N times, in turn, and keeps each one's
fastest run. ``--floor`` times, alone, the four objects every decoding request needs
each step in an engine built like this one (its chunk, its sampled id, its appended and
checked token, its `RequestOutput`): the least Python a step costs per request.
``--json`` writes the rows with that floor; ``--plot`` draws GPU busy % against running
requests from them (``--from-json`` redraws without measuring, ``--lang zh`` in Chinese).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

import torch

from minivllm.config import EngineConfig
from minivllm.detokenizer import Detokenizer
from minivllm.engine import LLMEngine
from minivllm.model_info import ModelInfo
from minivllm.model_runner import ModelRunner
from minivllm.models.config import ModelConfig
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput
from minivllm.simulator.clock import SimClock
from minivllm.simulator.cost_model import ChunkShape, step_cost
from minivllm.simulator.executor import SimulatedExecutor
from minivllm.simulator.hardware import get_hardware
from minivllm.simulator.models import get_model
from minivllm.utils import freeze_gc_heap

PROMPT_LEN = 256
BUDGET = 8192
FAKE_VOCAB = 64  # the stand-in model's logits: few, so the sampler's math costs ~nothing
FIRST_TOKEN = 17  # sampled ids are FIRST_TOKEN..FAKE_VOCAB - 1: SmolLM2's one-byte tokens
PHASES = ("schedule", "inputs", "sample", "outputs", "detok")


class NoComputeModel:
    """Stands in for the model inside the real `ModelRunner`: computes nothing. Its
    "hidden state" is the input token id, and the logits put all mass on a token that
    follows from it, so runs are deterministic. A one-layer, one-head config keeps the
    runner's KV cache a few MB."""

    def __init__(self) -> None:
        self.config = ModelConfig(
            vocab_size=FAKE_VOCAB, hidden_size=1, intermediate_size=1,
            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=1e-6,
            max_position_embeddings=1 << 20, inv_freq=torch.zeros(1),
        )  # fmt: skip

    def __call__(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        return input_ids

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        next_tokens = FIRST_TOKEN + (hidden * 31 + 7) % (FAKE_VOCAB - FIRST_TOKEN)
        logits = torch.zeros(len(hidden), FAKE_VOCAB)
        logits[torch.arange(len(hidden)), next_tokens] = 1.0
        return logits


class OverheadExecutor(SimulatedExecutor):
    """The simulator's executor (KV pool sized for the hardware, step time from the cost
    model) running the real `ModelRunner` on the no-compute model."""

    def __init__(self, config: EngineConfig, clock: SimClock) -> None:
        super().__init__(get_model("llama-3.1-8b"), get_hardware("h200"), config, clock)
        self.model_runner = ModelRunner(
            NoComputeModel(), self.num_kv_blocks, config.block_size, torch.float32,
            torch.device("cpu"),
        )  # fmt: skip
        self.last_gpu_seconds = 0.0

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        """With ``non_block`` (async scheduling), the step runs at once, in this thread,
        behind a done Future: the phase timers then see only their own calls."""
        self.charge_gpu_time(scheduler_output)
        output = self.model_runner.execute_model(scheduler_output)
        if not non_block:
            return output
        future = Future()
        future.set_result(output)
        return future

    def charge_gpu_time(self, scheduler_output: SchedulerOutput) -> None:
        """The cost model's time for the step, on the simulated clock. Working it out is
        the simulator's CPU time, not the engine's: `measure` leaves it out."""
        chunks = [
            ChunkShape(len(c.token_ids), c.context_len, c.sample) for c in scheduler_output.chunks
        ]
        self.last_gpu_seconds = step_cost(self.model, self.hardware, chunks).seconds
        self.clock.advance(self.last_gpu_seconds)


class PhaseTimer:
    """CPU seconds per phase: wraps methods so each call adds its process time."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys((*PHASES, "model", "gpu cost"), 0.0)
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)
        self._wrapped.append((owner, name, owner.__dict__.get(name)))
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] += time.process_time() - start

        setattr(owner, name, timed)

    def unwrap(self) -> None:
        for owner, name, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, name)  # an instance attribute shadowing the class's method
            else:
                setattr(owner, name, original)


@dataclass
class Row:
    running: int
    mode: str
    detokenize: bool
    steps: int
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per step, by phase
    cpu_total_ms: float = 0.0
    gpu_ms: float = 0.0
    tokens_per_step: float = 0.0
    async_scheduling: bool = False

    @property
    def busy(self) -> float:
        """The GPU's share of the time: it waits for all the CPU's work between two steps,
        or, with async scheduling, only for what the CPU's step takes beyond its own."""
        if self.async_scheduling:
            return self.gpu_ms / max(self.gpu_ms, self.cpu_total_ms)
        return self.gpu_ms / (self.gpu_ms + self.cpu_total_ms)


class Workload:
    """Deterministic requests: distinct 256-token prompts, streaming, EOS ignored."""

    def __init__(self, engine: LLMEngine, mode: str) -> None:
        self.engine, self.mode, self.next_id = engine, mode, 0

    def add(self, max_tokens: int) -> None:
        i = self.next_id
        self.next_id += 1
        prompt = [1000 + (i * 7919 + j * 104729) % 20000 for j in range(PROMPT_LEN)]
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        self.engine.add_request(str(i), {"prompt_token_ids": prompt}, params)

    def output_len(self) -> int:
        return 16 + (self.next_id * 37) % 257 if self.mode == "mixed" else 1 << 20

    def step(self) -> None:
        finished = sum(o.finished for o in self.engine.step())
        if self.mode == "mixed":
            for _ in range(finished):
                self.add(self.output_len())


def measure(
    running: int,
    mode: str,
    tokenizer,
    steps: int,
    profiler=None,
    freeze_gc: bool = True,
    async_scheduling: bool = False,
) -> Row:
    clock = SimClock()
    config = EngineConfig(
        max_num_seqs=running, max_num_batched_tokens=BUDGET, async_scheduling=async_scheduling
    )
    executor = OverheadExecutor(config, clock)
    # The engine's front end: the model's shape, and the tokenizer only to detokenize.
    model_info = ModelInfo(executor.model_config, tokenizer, eos_token_ids=frozenset())
    engine = LLMEngine(config, executor=executor, clock=clock, model_info=model_info)
    if freeze_gc:
        freeze_gc_heap()
    workload = Workload(engine, mode)
    for _ in range(running):
        workload.add(workload.output_len())
    # Warm up: every first prompt in (decode: all of them decoding), then a few more
    # steps (mixed: the churn has begun).
    scheduler = engine.scheduler
    for _ in range(-(-running * PROMPT_LEN // BUDGET)):
        workload.step()
    while mode == "decode" and any(s.num_output_tokens == 0 for s in scheduler.running):
        workload.step()
    for _ in range(10):
        workload.step()

    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update_from_output", "schedule")
    timer.wrap(executor.model_runner, "prepare_inputs", "inputs")
    runner = executor.model_runner  # prepare_inputs is subtracted from execute_model below
    timer.wrap(runner, "execute_model", "sample")
    # The stand-in model's calls are the GPU's work, not the engine's, and so is working
    # out what the GPU's step costs: left out.
    timer.wrap(runner.model, "compute_logits", "model")
    timer.wrap(executor, "charge_gpu_time", "gpu cost")
    if tokenizer is not None:
        for name in ("update", "finish"):
            timer.wrap(Detokenizer, name, "detok")
    cpu = gpu = tokens = 0.0
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        start = time.process_time()
        workload.step()
        cpu += time.process_time() - start
        gpu += executor.last_gpu_seconds
        tokens += engine.last_step.total_num_scheduled_tokens
    if profiler is not None:
        profiler.disable()
    timer.unwrap()
    s = timer.seconds
    cpu -= s["model"] + s["gpu cost"]
    s["sample"] -= s["inputs"] + s["model"]
    s["outputs"] = cpu - s["schedule"] - s["inputs"] - s["sample"]  # detok included
    s["outputs"] -= s["detok"]
    return Row(
        running, mode, tokenizer is not None, steps,
        cpu_ms={p: 1e3 * s[p] / steps for p in PHASES},
        cpu_total_ms=1e3 * cpu / steps, gpu_ms=1e3 * gpu / steps, tokens_per_step=tokens / steps,
        async_scheduling=async_scheduling,
    )  # fmt: skip


def per_request_floor(repeats: int = 20_000) -> dict[str, float]:
    """CPU microseconds of the few objects any engine built like this one makes for each
    decoding request in each step, each timed alone (the fastest of 5 rounds): the least
    Python a step can cost per request, whatever else is cut."""
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    table, tokens, stop_ids = tuple(range(20)), list(range(300)), frozenset({2})

    def chunk():  # the scheduler's record of the request's one new token
        ScheduledChunk("7", [5], 300, table, sample=True, sampling_params=params)

    def sampled_id():  # the runner hands back its sampled id
        {}["7"] = [5]

    def append_and_check():  # the token joins the request; stop token and length checked
        tokens.append(5)
        tokens.pop()
        return 5 in stop_ids or len(tokens) - 44 >= 4096

    def request_output():  # what a streaming client receives
        RequestOutput("7", None, tokens, [CompletionOutput(0, "", [5])], finished=False)

    costs = {}
    objects = {
        "chunk": chunk,
        "sampled id": sampled_id,
        "append + stop check": append_and_check,
        "RequestOutput": request_output,
    }
    for name, fn in objects.items():
        rounds = []
        for _ in range(5):
            start = time.process_time()
            for _ in range(repeats):
                fn()
            rounds.append((time.process_time() - start) / repeats)
        costs[name] = 1e6 * min(rounds)
    return costs


def markdown(rows: list[Row]) -> str:
    head = "| running | step | detok | " + " | ".join(PHASES) + " | CPU total | GPU step | busy |"
    lines = [head, "|" + " --- |" * (len(PHASES) + 6)]
    for r in rows:
        phases = " | ".join(f"{r.cpu_ms[p]:.2f}" for p in PHASES)
        lines.append(
            f"| {r.running} | {r.mode} ({r.tokens_per_step:.0f} tok)"
            f"{', async' if r.async_scheduling else ''} | "
            f"{'on' if r.detokenize else 'off'} | {phases} | {r.cpu_total_ms:.2f} | "
            f"{r.gpu_ms:.2f} | {100 * r.busy:.0f} % |"
        )
    return "\n".join(lines)


def floor_table(costs: dict[str, float], running_counts: list[int]) -> str:
    """The per-request costs, and what they alone add up to beside the simulated GPU step."""
    lines = ["| per decoding request, per step | µs |", "| --- | --- |"]
    lines += [f"| {name} | {us:.2f} |" for name, us in costs.items()]
    lines += [f"| all four | {sum(costs.values()):.2f} |", ""]
    lines += [
        "| running | these alone, ms per step | GPU step (ms) | share of the GPU step |",
        "| --- | --- | --- | --- |",
    ]
    model, hardware = get_model("llama-3.1-8b"), get_hardware("h200")
    for n in running_counts:
        chunks = [ChunkShape(1, PROMPT_LEN + 16, True)] * n  # as in the decode rows
        gpu_ms = 1e3 * step_cost(model, hardware, chunks).seconds
        floor_ms = n * sum(costs.values()) / 1e3
        lines.append(f"| {n} | {floor_ms:.2f} | {gpu_ms:.2f} | {100 * floor_ms / gpu_ms:.1f} % |")
    return "\n".join(lines)


LABELS = {
    "en": {
        "running": "running requests (every one decoding)",
        "busy": "GPU busy (%)",
        "title": "Engine CPU time against a simulated H200 step (llama-3.1-8b), {date}",
        "sync": "scheduled synchronously: GPU / (GPU + CPU)",
        "async": "async scheduling: GPU / max(GPU, CPU)",
        "floor": "synchronous, if the CPU built only the four objects per request",
    },
    "zh": {
        "running": "运行中的请求数（全部在 Decode）",
        "busy": "GPU 忙碌（%）",
        "title": "引擎的 CPU 时间对比模拟的 H200 一步（llama-3.1-8b），{date}",
        "sync": "同步调度：GPU / (GPU + CPU)",
        "async": "异步调度：GPU / max(GPU, CPU)",
        "floor": "同步调度，假如 CPU 每个请求只构造那四个对象",
    },
}


def plot(data: dict, path: str, lang: str) -> None:
    """GPU busy % against running decodes, synchronous and async, beside what the
    per-request floor alone would leave; an SVG keeps its labels as text."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # the browser draws the (CJK) text
    matplotlib.rcParams["svg.hashsalt"] = "overhead"  # same data, same file
    import matplotlib.pyplot as plt

    text = LABELS[lang]
    decode = [r for r in data["rows"] if r["mode"] == "decode" and not r["detokenize"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for scheduling, style in (("sync", "o-"), ("async", "s-")):
        rows = [r for r in decode if r["async_scheduling"] == (scheduling == "async")]
        ax.plot([r["running"] for r in rows], [100 * r["busy"] for r in rows], style,
                label=text[scheduling])  # fmt: skip
    floor_us = sum(data["floor_us"].values())
    rows = [r for r in decode if not r["async_scheduling"]]
    floor = [100 * r["gpu_ms"] / (r["gpu_ms"] + r["running"] * floor_us / 1e3) for r in rows]
    ax.plot([r["running"] for r in rows], floor, "k:", label=text["floor"])
    running = sorted({r["running"] for r in decode})
    ax.set_xscale("log", base=2)
    ax.set_xticks(running, [str(n) for n in running])
    ax.set_xlabel(text["running"])
    ax.set_ylabel(text["busy"])
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(text["title"].format(date=data["date"]), fontsize=9)
    ax.grid(True, alpha=0.3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, dpi=120, metadata={"Date": None})
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="64,256,512,1024")
    p.add_argument("--modes", default="decode,mixed")
    p.add_argument("--detokenize", default="off,on")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokenizer", default=None, help="default: the SmolLM2 checkpoint's")
    p.add_argument(
        "--scheduling",
        default="sync",
        help="sync, async or both (sync,async); async: the engine's async path, "
        "busy = GPU / max(GPU, CPU): CPU work overlaps the GPU",
    )
    p.add_argument("--async-scheduling", action="store_true", help="same as --scheduling async")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every configuration this many times, in turn, and keep each one's "
        "fastest run (a shared machine's other work slows runs down, never speeds them up)",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the measured steps")
    p.add_argument(
        "--floor",
        action="store_true",
        help="only time the objects every decoding request costs per step, and what they "
        "alone add up to at each --running count",
    )
    p.add_argument(
        "--no-freeze-gc", action="store_true", help="leave start-up objects to the collector"
    )
    p.add_argument("--json", default=None, help="write the rows and the floor here")
    p.add_argument("--from-json", default=None, help="plot these rows instead of measuring")
    p.add_argument("--plot", default=None, help="draw GPU busy %% against running (an SVG)")
    p.add_argument("--lang", choices=sorted(LABELS), default="en")
    args = p.parse_args(argv)

    if args.floor:
        print(floor_table(per_request_floor(), [int(n) for n in args.running.split(",")]))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
    else:
        data = run(args, argv)
    if args.plot:
        plot(data, args.plot, args.lang)
    return 0


def run(args, argv: list[str] | None) -> dict:
    tokenizer = None
    if "on" in args.detokenize.split(","):
        from minivllm.models.loader import load_tokenizer
        from minivllm.models.model_files import default_model_path

        tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    schedulings = ["async"] if args.async_scheduling else args.scheduling.split(",")
    configs = [
        (detok, mode, running, scheduling == "async")
        for detok in args.detokenize.split(",")
        for mode in args.modes.split(",")
        for running in map(int, args.running.split(","))
        for scheduling in schedulings
    ]
    profiler = cProfile.Profile() if args.profile else None
    fastest: dict[tuple, Row] = {}
    for _ in range(args.repeats):
        for config in configs:
            detok, mode, running, async_scheduling = config
            tok = tokenizer if detok == "on" else None
            row = measure(
                running, mode, tok, args.steps, profiler, not args.no_freeze_gc,
                async_scheduling,
            )  # fmt: skip
            print(markdown([row]).splitlines()[-1], flush=True)
            if config not in fastest or row.cpu_total_ms < fastest[config].cpu_total_ms:
                fastest[config] = row
    rows = [fastest[c] for c in configs]
    print("\nCPU milliseconds per step (llama-3.1-8b on one H200, simulated):\n")
    print(markdown(rows))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    data = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/overhead.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "rows": [asdict(r) | {"busy": r.busy} for r in rows],
        "floor_us": per_request_floor(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    raise SystemExit(main())
