"""The mutation score of the last `make mutation` run, and the mutants the tests missed.

    python tests/mutation_report.py [--diffs] [--equivalent]

Reads mutmut's results (``mutants/**/*.py.meta``, written by ``mutmut run``), leaves out
the *equivalent* mutants (edits that change no behaviour anyone can observe, so no test
can kill them: those listed below, and edits of an assert's message text), and prints,
per module, killed / (checked - equivalent), then every surviving mutant (``--diffs``:
with its diff, from ``mutmut show``).

Mutant names are ``module.function__mutmut_N``; the numbers shift when the function's
source changes, so after editing a module re-check its equivalent mutants here: a stale
number names another mutant of the same function, which is then excused by the wrong
reason unless a test kills it (``--equivalent`` prints each name with its reason; compare
with ``mutmut show NAME``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # a failing test, a timeout, a crash
SURVIVED = {0}
NOT_TESTED = {5, 33}  # no test reaches the function: a survivor too

SAMPLER = "minivllm.sampler."
REJECTION_SAMPLER = "minivllm.spec_decode.rejection_sampler."
DETOKENIZER = "minivllm.detokenizer.x\u01c1Detokenizer\u01c1"
LOGPROBS = "minivllm.logprobs."
INPUT_BATCH = "minivllm.input_batch.x\u01c1InputBatch\u01c1"
SO_MANAGER = "minivllm.structured_output.manager.x\u01c1StructuredOutputManager\u01c1"
SO_CLOCK = (
    "a CPU time measured as `thread_time() + start` for `- start`: in the mutation run's "
    "forked worker the thread clock starts near 0, so the two differ by less than a timing "
    "test can rely on (the stats are reported, never acted on)"
)
# name -> why no test can tell the mutant from the original (checked by hand).
EQUIVALENT: dict[str, str] = {
    "minivllm.kv_cache_manager.x_hash_block_tokens__mutmut_8": (
        'array("Q") for array("q"): token ids are never negative (add_request checks), and '
        "a non-negative id has the same 8 bytes signed or unsigned"
    ),
    "minivllm.static_scheduler.x\u01c1StaticBatchScheduler\u01c1__init____mutmut_10": (
        "num_decode_steps starts at None: _start_batch sets it to 0 before anything reads it"
    ),
    "minivllm.static_scheduler.x\u01c1StaticBatchScheduler\u01c1__init____mutmut_11": (
        "num_decode_steps starts at 1: _start_batch sets it to 0 before anything reads it"
    ),
    REJECTION_SAMPLER + "x_accept_random__mutmut_10": (
        "`u <= p` for `u < p`: differs only when the uniform draw equals p exactly, which has "
        "probability 0 (2^-24 per draw in float32)"
    ),
    "minivllm.block_allocator.x\u01c1BlockAllocator\u01c1free__mutmut_8": (
        'free_block_ids[block_id] = "" for None: the free queue is an OrderedDict used as an '
        "ordered set, its values are never read"
    ),
    "minivllm.block_allocator.x\u01c1BlockAllocator\u01c1allocate__mutmut_7": (
        "popitem(last=None) for last=False: None is false too, the oldest free block is taken"
    ),
    "minivllm.kv_cache_manager.x\u01c1KVCacheManager\u01c1cache_full_blocks__mutmut_30": (
        "range(end) for range(first, end): blocks before `first` are registered already, and "
        "registering a block again under the hash it has changes nothing (only costs hashing)"
    ),
    "minivllm.kv_cache_manager.x\u01c1KVCacheManager\u01c1cache_full_blocks__mutmut_10": (
        "the early return taken less often (`and` for `or`): the full path then registers "
        "nothing, as no block is full (end 0) or the walk back stops at the registered last "
        "full one (both callers have allocated the sequence's blocks: its table is not empty)"
    ),
    "minivllm.kv_cache_manager.x\u01c1KVCacheManager\u01c1__init____mutmut_14": (
        "table ids counted from 2, not 1: any ids do that differ from 0 and from each other"
    ),
    "minivllm.kv_cache_manager.x\u01c1KVCacheManager\u01c1allocate_slots__mutmut_4": (
        "the blocks to copy counted at admission too: 0 there anyway, an admitted sequence "
        "has computed nothing (new, or reset by preemption)"
    ),
    **{
        f"minivllm.kv_cache_manager.x\u01c1KVCacheManager\u01c1allocate_slots__mutmut_{n}": (
            "the decode shortcut taken less often (`<` for `<=`, `/` for `*`): it only saves "
            "work, the full path then finds no block missing and returns True, taking nothing"
        )
        for n in (13, 14)
    },
    "minivllm.scheduler.x\u01c1Scheduler\u01c1_schedule_running__mutmut_5": (
        "`budget >= 0` for `> 0`: with no budget left each sequence gets 0 new tokens, which "
        "the branch for idle beams skips: nothing scheduled, nothing preempted"
    ),
    "minivllm.scheduler_output.x\u01c1SchedulerOutput\u01c1add__mutmut_4": (
        "placeholders added when the known ids fill the chunk too (`<=`): [-1] * 0, none"
    ),
    "minivllm.scheduler_output.x\u01c1SchedulerOutput\u01c1add__mutmut_45": (
        "prompt-logprob targets cut at num_prompt_tokens + 1 for - 1: the slice of the prompt "
        "stops at its end either way"
    ),
    "minivllm.detokenizer.x\u01c1Detokenizer\u01c1__init____mutmut_9": (
        "_prefix_offset starts at None: token_ids[None:...] slices from 0, like 0, until the "
        "first decoded text sets it"
    ),
    "minivllm.detokenizer.x\u01c1Detokenizer\u01c1__init____mutmut_48": (
        "getattr's default None for False, for a tokenizer without clean_up_tokenization_spaces: "
        "both are false, so the Rust core is used either way"
    ),
    "minivllm.detokenizer.x\u01c1Detokenizer\u01c1finish__mutmut_10": (
        "the offsets set to None in finish(): it is the request's last call (the output "
        "processor stops the request right after), so they are never read again"
    ),
    SAMPLER + "x\u01c1Sampler\u01c1_mask_stops_before_min_tokens__mutmut_21": (
        'float("-INF") is float("-inf")'
    ),
    SAMPLER + "x__apply_top_k__mutmut_13": (
        "`0 < k <= vocab_size`: k = vocab_size keeps the whole vocabulary either way"
    ),
    SAMPLER + "x__apply_top_k__mutmut_38": 'float("-INF") is float("-inf")',
    SAMPLER + "x__apply_top_p__mutmut_43": 'float("-INF") is float("-inf")',
    SAMPLER + "x_apply_token_bias__mutmut_18": 'float("-INF") is float("-inf")',
    SAMPLER + "x_apply_token_bias__mutmut_35": (
        "biases.to(None) for .to(logits.dtype): both are float32 (both callers pass "
        "logits.float()), and an in-place += casts to the logits' dtype anyway"
    ),
    **{
        SAMPLER + f"x\u01c1Sampler\u01c1__call____mutmut_{n}": (
            "a row without penalties has its token ids gathered too (`or True`): apply_penalties "
            "leaves a neutral row bit for bit (test_neutral_rows_are_left_bit_for_bit)"
        )
        for n in (23, 29)
    },
    SAMPLER + "x_sampling_probs__mutmut_16": (
        "top-k applied when every top_k is 0: k = 0 means the whole vocabulary, keeps all"
    ),
    SAMPLER + "x_sampling_probs__mutmut_24": (
        "top-p applied with p = 1 (as `top_p <= 1`): drops only tokens after a cumulative "
        "mass of 1.0, i.e. below float32 resolution"
    ),
    SAMPLER + "x_sampling_probs__mutmut_25": (
        "top-p applied with p = 1 (as `top_p < 2`): drops only tokens after a cumulative "
        "mass of 1.0, i.e. below float32 resolution"
    ),
    SAMPLER + "x_sampling_probs__mutmut_36": (
        "min-p applied with min_p = 0: masks probabilities below 0, none"
    ),
    # DEVICE below, where the diff cannot show it: a `device` variable, a positional argument.
    **{
        SAMPLER + f"x_apply_penalties__mutmut_{n}": (
            "the penalties' device set to None: the CPU either way in the mutation run"
        )
        for n in (4, 8, 16)
    },
    SAMPLER + "x_apply_penalties__mutmut_54": (
        "repetition penalty: `logits >= 0` for `> 0`: a logit of 0 divided or multiplied by "
        "the penalty is 0 either way"
    ),
    **{
        SAMPLER + f"x__token_counts__mutmut_{n}": (
            "max's default (None, none, 1 for 0) is used only for a batch of no rows, and "
            "penalties are applied only when some row has them"
        )
        for n in (3, 5, 6)
    },
    **{
        SAMPLER + f"x__token_counts__mutmut_{n}": (
            "the index tensor without dtype=torch.long: int64 anyway from the ids, and when "
            "every list is empty an empty index, of any dtype, scatters nothing"
        )
        for n in (13, 16)
    },
    **{
        SAMPLER + f"x__token_counts__mutmut_{n}": (
            "the counts without dtype=torch.float32: torch's default dtype, which the engine "
            "never changes"
        )
        for n in (24, 28)
    },
    SAMPLER + "x__token_counts__mutmut_31": (
        "vocab_size + 2 columns for + 1: one more padding column, dropped with the other"
    ),
    **{
        f"minivllm.sequence.x\u01c1Sequence\u01c1__init____mutmut_{n}": (
            "the first snapshot and its key (None, (1, 0), (0, 1)): never returned, a real key "
            "either has id 0 (always taken afresh) or differs; an empty table's snapshot is () "
            "either way"
        )
        for n in (17, 18, 19, 20)
    },
    "minivllm.beam_search.x\u01c1BeamSearchGroup\u01c1__init____mutmut_27": (
        "finished starts at None for False: only read as a condition"
    ),
    "minivllm.sequence.x\u01c1Sequence\u01c1__init____mutmut_26": (
        "shares_prompt starts at None for False: only read as a condition (KVCacheManager._caches)"
    ),
    DETOKENIZER + "_find_stop_string__mutmut_4": (
        "`and` for `or` in the early exit: with no new characters the loop's range is empty, "
        "with no stop strings there is no length to try; None either way"
    ),
    DETOKENIZER + "_find_stop_string__mutmut_18": (
        "the scan reaches end = len(text) + 1: the slice there is the text's last length - 1 "
        "characters, a match only if that is a stop string, one the scan already found ending "
        "at len(text) with the same cut (with include_stop_str_in_output its cut, past the "
        "text, loses to that one's)"
    ),
    DETOKENIZER + "_find_stop_string__mutmut_33": (
        "`<=` for `<`: no two candidates are equal (each is one (end, stop) pair; a stop's "
        "rank is its own), so a tie never happens"
    ),
    LOGPROBS + "x_compute_logprobs__mutmut_27": (
        "topk(0) also when no row asks for top tokens: two empty tensors, which no row reads "
        "(num_top[i] is 0 for every row)"
    ),
    LOGPROBS + "x_compute_logprobs__mutmut_31": "topk without dim=-1: -1 is topk's default",
    **{
        INPUT_BATCH + name: (
            "which row holds a request, and how many spare rows there are: not observable, "
            "a step's tensors are built from its chunks' rows in order (rows are still reused: "
            "test_memory_follows_the_requests_in_flight_not_the_requests_served)"
        )
        for name in [f"__init____mutmut_{n}" for n in (1, 23, 28, 29, 30, 32, 33, 35, 36)]
        + [f"_take_row__mutmut_{n}" for n in (5, 17, 21)]
    },
    **{
        INPUT_BATCH + name: (
            "more spare columns in the block-table array (or grown one block earlier): only "
            "the first max_blocks columns of a step's rows are read"
        )
        for name in ("__init____mutmut_9", "_update_row__mutmut_18", "_update_row__mutmut_22")
    },
    **{
        INPUT_BATCH + name: (
            "table ids kept as float64, not int64: compared with != to ids below 2^53, which "
            "float64 holds exactly"
        )
        for name in (
            "__init____mutmut_17",
            "__init____mutmut_19",
            "_grow__mutmut_22",
            "_grow__mutmut_24",
        )  # fmt: skip
    },
    **{
        INPUT_BATCH + f"_grow__mutmut_{n}": (
            "num_blocks / table_ids / row_sources grown past the last row: entries no row "
            "index reaches"
        )
        for n in (18, 25, 29)
    },
    INPUT_BATCH + "_update_row__mutmut_17": (
        "`>=` for `>` before copying the new blocks: with none, the copy is of an empty slice"
    ),
    **{
        INPUT_BATCH + f"prepare__mutmut_{n}": (
            "np.fromiter without its count: the count only sizes the array up front"
        )
        for n in (9, 18, 25, 34)
    },
    "minivllm.spec_decode.scheduler.x\u01c1SpecDecodeScheduler\u01c1update_from_output__mutmut_2": (
        "the base scheduler's update_from_output given None for the runner's output: it does "
        "not read it (only the rollback here does)"
    ),
    "minivllm.spec_decode.scheduler.x\u01c1SpecDecodeScheduler\u01c1update_from_output__mutmut_7": (
        "the loop over the scheduled sequences also when no request carried drafts: a "
        "shortcut, each sequence without drafts is skipped anyway"
    ),
    "minivllm.model_runner.x\u01c1ModelRunner\u01c1__init____mutmut_30": (
        "the input batch's device set to None: its tensors stay on the CPU, where the mutation "
        "run is"
    ),
    "minivllm.model_runner.x\u01c1ModelRunner\u01c1__init____mutmut_35": (
        "prev_sampled_token_ids starts at None: the first step has no placeholder to fill "
        "(nothing was sampled before it), and every step sets it"
    ),
    "minivllm.beam_search.x\u01c1BeamSearchGroups\u01c1after_step__mutmut_6": (
        "a failed search reported with its first beam's prompt even with no beam (`or True`): "
        "a search in flight always has a beam (one whose beams all ended is finished and "
        "popped in the same after_step), so the guard's `else None` never runs"
    ),
    "minivllm.model_runner.x\u01c1ModelRunner\u01c1_sample__mutmut_12": (
        "the sampler called on a step with no chunk to sample too (`or True`; a step that "
        "only wants prompt logprobs): a shortcut, the sampler returns [] for no rows"
    ),
    SO_MANAGER + "__init____mutmut_11": (
        "said_overlap_paused starts at None for False: both are falsy, the first pause is "
        "logged either way"
    ),
    SO_MANAGER + "shutdown__mutmut_2": (
        "the compile thread shut down with wait=None for False: both are falsy, it does not wait"
    ),
    SO_MANAGER + "accept_tokens__mutmut_20": (
        "an empty body (the step's only token was EOS) passed to the matcher too: accepting "
        "no tokens is a no-op that succeeds"
    ),
    SO_MANAGER + "_compile__mutmut_11": SO_CLOCK,
    SO_MANAGER + "accept_tokens__mutmut_30": SO_CLOCK,
    SO_MANAGER + "grammar_bitmask__mutmut_45": SO_CLOCK,
    INPUT_BATCH + "_drop_absent__mutmut_7": (
        "a freed row's source set to \"\" for None: it only has to be no chunk's table, and "
        '"" is none either'
    ),
    INPUT_BATCH + "_update_row__mutmut_6": (
        "the row's source never recorded: the identity shortcut never fires, and the full "
        "path finds the same table under the same id and copies nothing new"
    ),
    INPUT_BATCH + "__init____mutmut_3": (
        "the batch's device set to None: its tensors stay on the CPU, where the mutation run is"
    ),
}
ASSERT_MESSAGE = "the text of an assert's message (shown only when an invariant is broken)"
LAST_AXIS = (
    "the (rejection) sampler's and the logprobs' tensors are 2-D [rows, vocab_size]: axis +1 "
    "is axis -1"
)
DEVICE = "device placement (device=, non_blocking=): only observable on a GPU, not on the CPU"
STRING = re.compile(r"""[rbf]*("[^"]*"|'[^']*')""")


def why_equivalent(name: str, diff: str) -> str | None:
    """The reason a mutant changes nothing observable, or None: the hand-checked list
    above, or one of three kinds recognised from the diff: an assert's message text, a
    tensor created without its device (CPU either way here) and, in the sampler, the
    rejection sampler and the logprobs, axis +1 for -1."""
    if name in EQUIVALENT:
        return EQUIVALENT[name]
    lines = [line for line in diff.splitlines() if not line.startswith(("---", "+++"))]
    removed = " ".join(line[1:].strip() for line in lines if line.startswith("-"))
    added = " ".join(line[1:].strip() for line in lines if line.startswith("+"))
    if removed == added:  # a change this comparison cannot see: judge it by hand
        return None
    if removed.startswith("assert ") and STRING.sub('""', removed) == STRING.sub('""', added):
        return ASSERT_MESSAGE
    last_axis_modules = (SAMPLER, REJECTION_SAMPLER, LOGPROBS)
    if name.startswith(last_axis_modules) and _last_axis(removed) == _last_axis(added):
        return LAST_AXIS
    if _no_device(removed) == _no_device(added):
        return DEVICE
    return None


def _last_axis(line: str) -> str:
    return line.replace("+1", "-1").replace("dim=-1, ", "")


def _no_device(line: str) -> str:
    """The line without device placement: ``device=...`` and ``non_blocking=...`` (which
    only decides whether a host-to-GPU copy waits)."""
    line = re.sub(r"(device|non_blocking)=[\w.]+", "", line)
    line = re.sub(r"\(\s*,\s*", "(", line)
    return re.sub(r"[,\s]+\)", ")", line)


def show(name: str, source_path: Path) -> str:
    """The mutant's diff, as ``mutmut show`` prints it (mutmut's own function, in-process:
    a process per mutant would take minutes)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    return get_diff_for_mutant(name, path=source_path)


def load_results(root: Path = Path("mutants")) -> dict[str, tuple[int | None, Path]]:
    """Each mutant's exit code (None: not run yet) and the source file it mutates."""
    results: dict[str, tuple[int | None, Path]] = {}
    for meta in sorted(root.rglob("*.py.meta")):
        source_path = meta.relative_to(root).with_suffix("")
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            results[name] = (code, source_path)
    return results


def module_of(mutant_name: str) -> str:
    return mutant_name.split(".x\u01c1")[0].rsplit("__mutmut_", 1)[0].rsplit(".x_", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    parser.add_argument("--equivalent", action="store_true", help="list the equivalent ones")
    args = parser.parse_args()

    results = load_results()
    if not results:
        raise SystemExit("no mutmut results under mutants/: run `make mutation` first")
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors, equivalent = [], []
    for name, (code, source_path) in sorted(results.items()):
        module = module_of(name)
        if code is None:
            counts[module]["not checked"] += 1
        elif code in KILLED:
            counts[module]["killed"] += 1
        elif reason := why_equivalent(name, show(name, source_path)):
            counts[module]["equivalent"] += 1
            equivalent.append((name, reason))
        else:
            counts[module]["survived"] += 1
            survivors.append(name)

    print(f"{'module':38} {'killed':>6} {'survived':>8} {'equivalent':>10} {'unchecked':>9} score")
    total = Counter()
    for module, c in sorted(counts.items()):
        total += c
        print(_row(module, c))
    print(_row("all", total))
    if args.equivalent:
        print(f"\n{len(equivalent)} equivalent mutants, not counted:")
        for name, reason in equivalent:
            print(f"  {name}: {reason}")
    if survivors:
        print(f"\n{len(survivors)} surviving mutants (`mutmut show NAME` for the diff):")
    for name in survivors:
        print(" ", name)
        if args.diffs:
            diff = show(name, results[name][1])
            print("    " + diff.strip().replace("\n", "\n    "))


def _row(module: str, c: Counter) -> str:
    checked = c["killed"] + c["survived"]
    score = f"{c['killed'] / checked:.1%}" if checked else "-"
    return (
        f"{module:38} {c['killed']:6d} {c['survived']:8d} {c['equivalent']:10d} "
        f"{c['not checked']:9d} {score}"
    )


if __name__ == "__main__":
    main()
