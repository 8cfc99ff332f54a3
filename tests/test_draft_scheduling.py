"""How the continuous scheduler schedules draft tokens (speculative decoding), with no model.

Each rule of `Scheduler._schedule_drafts` and of the roll-back in `update_from_output`,
reached on purpose with hand-built sequences, a real `KVCacheManager` and a real
`NgramProposer`:

- only decodes get drafts, up to ``k``, proposed from the request's own tokens;
- drafts take only what is left: the token budget after every real token (oldest decode
  first), free blocks after every admission; they never preempt anyone;
- each draft may become an output token, so ``max_tokens`` and ``max_model_len`` cap them;
- no drafts while ``min_tokens`` still bans stops, nor with ``min_p``;
- rejected drafts move ``num_computed_tokens`` back and give their blocks back;
- only verified, known tokens enter the prefix cache;
- the spec-decode counters count each verified run of drafts.

The prompts cycle through ``1 2 3 4``, so the proposer's drafts are the cycle's next
tokens, and the pretend model samples the cycle too: it accepts every draft unless a test
says how many it accepts (the token after those is then `CORRECTION`, off the cycle).
"""

from __future__ import annotations

import pytest

from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import Sequence
from minivllm.spec_decode import NgramProposer
from minivllm.spec_decode.scheduler import SpecDecodeScheduler

CYCLE = [1, 2, 3, 4]
CORRECTION = 9  # what the pretend model samples where it rejects a draft


def cyclic(num_tokens: int) -> list[int]:
    return [CYCLE[i % len(CYCLE)] for i in range(num_tokens)]


def make_scheduler(num_blocks=32, k=3, budget=64, max_model_len=1000, prefix_caching=False):
    manager = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=prefix_caching)
    return SpecDecodeScheduler(
        manager,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        clock=lambda: 0.0,
        max_model_len=max_model_len,
        proposer=NgramProposer(k, prompt_lookup_min=1, prompt_lookup_max=2),
    )


def make_seq(request_id: str, prompt_len: int, **params) -> Sequence:
    return Sequence(request_id, cyclic(prompt_len), SamplingParams(temperature=0, **params))


def add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add_request(seq)


def sampled_tokens(seq: Sequence, drafts: list[int], num_accepted: int) -> list[int]:
    """What the pretend model emits: the accepted drafts, then the bonus token (the cycle's
    next) if it accepted all, else the correction."""
    if num_accepted == len(drafts):
        return drafts + [CYCLE[(seq.num_tokens + len(drafts)) % len(CYCLE)]]
    return drafts[:num_accepted] + [CORRECTION]


def run(scheduler: Scheduler, out: SchedulerOutput, num_accepted: dict[str, int] | None = None):
    """Pretend the model ran ``out``, then append the sampled tokens (the output
    processor's job, after `update_from_output`). ``num_accepted``: drafts the model
    accepts per request (default: all)."""
    sampled = {}
    for chunk, seq in zip(out.chunks, out.scheduled_seqs):
        if chunk.sample:
            drafts = chunk.draft_token_ids
            accepted = (num_accepted or {}).get(seq.request_id, len(drafts))
            sampled[seq.request_id] = sampled_tokens(seq, drafts, accepted)
    scheduler.update_from_output(out, ModelRunnerOutput(sampled))
    for seq in out.scheduled_seqs:
        for token in sampled.get(seq.request_id, []):
            seq.append_token(token, now=0.0)


def step(scheduler: Scheduler, num_accepted: dict[str, int] | None = None) -> SchedulerOutput:
    out = scheduler.schedule()
    run(scheduler, out, num_accepted)
    return out


def drafts_of(out: SchedulerOutput) -> dict[str, list[int]]:
    return out.scheduled_spec_decode_tokens


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {seq.request_id: out.num_scheduled_tokens[seq.request_id] for seq in out.scheduled_seqs}


def cache_hit(scheduler: Scheduler, prompt: list[int]) -> int:
    """Tokens a new request with ``prompt`` would find in the prefix cache."""
    probe = Sequence("probe", prompt, SamplingParams())
    manager = scheduler.kv_cache_manager
    return len(manager.get_computed_blocks(probe)) * manager.block_size


# --- which requests get drafts --------------------------------------------------------------


def test_a_decode_carries_k_drafts_from_its_own_tokens_and_a_prefill_none():
    scheduler = make_scheduler(k=3)
    a = make_seq("a", 8)
    add(scheduler, a)
    out = step(scheduler)  # the whole prompt, budget to spare: still no drafts
    assert scheduled(out) == {"a": 8} and drafts_of(out) == {}
    assert a.token_ids == cyclic(9)

    out = scheduler.schedule()
    # [.. 4 1]: the 2-gram [4 1] first occurred at index 3, followed by 2 3 4.
    assert drafts_of(out) == {"a": [2, 3, 4]}
    [chunk] = out.chunks
    assert (chunk.token_ids, chunk.start_position, chunk.num_draft_tokens) == ([1, 2, 3, 4], 8, 3)
    assert chunk.sample and chunk.draft_token_ids == [2, 3, 4]
    assert out.num_scheduled_tokens == {"a": 4} and out.num_draft_tokens == 3
    assert out.is_prefill == {"a": False}
    assert len(a.block_table) == 3  # positions 8..11 need the third block
    run(scheduler, out)
    assert a.num_computed_tokens == 12 and a.token_ids == cyclic(13)  # 4 tokens in one step


def test_the_last_chunk_of_a_chunked_prompt_gets_no_drafts():
    scheduler = make_scheduler(k=3, budget=6)
    a = make_seq("a", 8)
    add(scheduler, a)
    assert scheduled(step(scheduler)) == {"a": 6}
    out = step(scheduler)  # the last 2 prompt tokens: a prefill, 4 tokens of budget left
    assert scheduled(out) == {"a": 2} and drafts_of(out) == {}
    assert drafts_of(step(scheduler)) == {"a": [2, 3, 4]}


def test_a_request_whose_tokens_never_repeat_gets_no_drafts():
    scheduler = make_scheduler(k=3)
    a = Sequence("a", [5, 6, 7, 8], SamplingParams(temperature=0))
    add(scheduler, a)
    step(scheduler)  # the model appends 1: [5 6 7 8 1], no n-gram occurred before
    out = scheduler.schedule()
    assert scheduled(out) == {"a": 1} and drafts_of(out) == {}


@pytest.mark.parametrize(
    "min_tokens, min_p, expected",
    [(0, 0.0, [2, 3, 4]), (1, 0.0, [2, 3, 4]), (2, 0.0, []), (0, 0.1, [])],
)
def test_no_drafts_while_min_tokens_bans_stops_nor_with_min_p(min_tokens, min_p, expected):
    """One output token so far: ``min_tokens`` 1 is reached (the EOS mask is off for every
    draft position), 2 is not; ``min_p`` is never verified, as in vLLM."""
    scheduler = make_scheduler(k=3)
    a = make_seq("a", 8, min_tokens=min_tokens, min_p=min_p)
    add(scheduler, a)
    step(scheduler)
    assert a.num_output_tokens == 1
    out = scheduler.schedule()
    assert drafts_of(out).get("a", []) == expected
    assert scheduled(out) == {"a": 1 + len(expected)}


def test_a_request_without_drafts_does_not_stop_the_ones_after_it():
    """a may not draft (min_p), b finds no earlier n-gram: c, the newest, still drafts."""
    scheduler = make_scheduler(k=3)
    a, c = make_seq("a", 8, min_p=0.1), make_seq("c", 8)
    b = Sequence("b", [5, 6, 7, 8], SamplingParams(temperature=0))
    add(scheduler, a, b, c)
    step(scheduler)
    out = scheduler.schedule()
    assert scheduled(out) == {"a": 1, "b": 1, "c": 4}
    assert drafts_of(out) == {"c": [2, 3, 4]}


def test_a_decode_without_drafts_first_does_not_stop_the_roll_back_of_the_ones_after_it():
    """a decodes one token (min_p: no drafts), then c's 3 drafts are all rejected: c
    computed its real token only, and a its one."""
    scheduler = make_scheduler(k=3)
    a, c = make_seq("a", 8, min_p=0.1), make_seq("c", 8)
    add(scheduler, a, c)
    step(scheduler)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled_seqs] == ["a", "c"]
    assert drafts_of(out) == {"c": [2, 3, 4]}
    run(scheduler, out, {"c": 0})
    assert (a.num_computed_tokens, c.num_computed_tokens) == (9, 9)
    assert scheduler.spec_decoding_stats.num_draft_tokens == 3


def test_the_spec_scheduler_needs_a_proposer_and_a_length_cap():
    manager = KVCacheManager(8, block_size=4)
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=2)
    for kwargs in (dict(proposer=proposer), dict(max_model_len=64)):
        with pytest.raises(AssertionError):
            SpecDecodeScheduler(manager, max_num_seqs=2, max_num_batched_tokens=8, **kwargs)


def test_only_a_decode_can_carry_drafts():
    prefill, decode = make_seq("p", 8), make_seq("d", 8)
    decode.append_token(1, now=0.0)
    decode.num_computed_tokens = 8
    out = SchedulerOutput()
    out.add(prefill, 8)
    out.add(decode, 1)
    with pytest.raises(AssertionError):
        out.add_draft_tokens(prefill, [1, 2])
    with pytest.raises(AssertionError):
        out.add_draft_tokens(decode, [])
    out.add_draft_tokens(decode, [2, 3])
    assert out.num_scheduled_tokens == {"p": 8, "d": 3}


def test_the_plain_scheduler_keeps_no_draft_counters_and_the_spec_one_one_per_position():
    manager = KVCacheManager(8, block_size=4)
    plain = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    assert not hasattr(plain, "spec_decoding_stats")  # drafts live in spec_decode/ alone
    assert make_scheduler(k=3).spec_decoding_stats.num_accepted_tokens_per_pos == [0, 0, 0]


# --- drafts take only what is left -----------------------------------------------------------


@pytest.mark.parametrize(
    "budget, expected",
    [
        (2, {}),
        (3, {"a": [2]}),
        (5, {"a": [2, 3, 4]}),
        (6, {"a": [2, 3, 4], "b": [2]}),
        (64, {"a": [2, 3, 4], "b": [2, 3, 4]}),
    ],
)
def test_drafts_spend_only_the_budget_left_oldest_decode_first(budget, expected):
    scheduler = make_scheduler(k=3)
    add(scheduler, make_seq("a", 8), make_seq("b", 8))
    step(scheduler)
    scheduler.max_num_batched_tokens = budget
    out = scheduler.schedule()
    assert drafts_of(out) == expected
    assert scheduled(out) == {r: 1 + len(expected.get(r, [])) for r in ("a", "b")}
    assert out.total_num_scheduled_tokens <= budget


def test_drafts_never_delay_an_admission():
    """The waiting c is admitted with its whole prompt before a decode gets a draft."""
    scheduler = make_scheduler(k=3)
    add(scheduler, make_seq("a", 8), make_seq("b", 8))
    step(scheduler)
    add(scheduler, make_seq("c", 4))
    scheduler.max_num_batched_tokens = 8
    out = scheduler.schedule()
    assert scheduled(out) == {"a": 3, "b": 1, "c": 4}
    assert drafts_of(out) == {"a": [2, 3]}


@pytest.mark.parametrize(
    "num_blocks, expected",
    [(5, {"b": [3, 4]}), (6, {"a": [1, 2], "b": [3, 4]})],
)
def test_drafts_take_only_free_blocks_and_never_preempt(num_blocks, expected):
    """a's decode fills its second block, so its drafts need a third; b's fit in its own
    last block. With 5 blocks the pool is full: a decodes one token, b still drafts, and
    nobody is preempted for a draft."""
    scheduler = make_scheduler(num_blocks=num_blocks, k=2)
    a, b = make_seq("a", 7), make_seq("b", 9)
    add(scheduler, a, b)
    step(scheduler)  # a: 2 blocks, b: 3 blocks
    out = scheduler.schedule()
    assert out.preempted == [] and scheduler.running == [a, b]
    assert drafts_of(out) == expected
    assert len(a.block_table) == (3 if "a" in expected else 2)
    assert len(b.block_table) == 3
    assert scheduler.kv_cache_manager.num_free_blocks == 0


def test_after_a_request_preempts_itself_the_budget_left_still_caps_the_drafts():
    """b, the newest, needs a block the full pool does not have: it is its own victim.
    a decoded one token of the 3; the 2 left become its drafts (in b's freed blocks)."""
    scheduler = make_scheduler(num_blocks=4, k=3)
    a, b = make_seq("a", 7), make_seq("b", 8)
    add(scheduler, a, b)
    step(scheduler)
    scheduler.max_num_batched_tokens = 3
    out = scheduler.schedule()
    assert out.preempted == [b] and scheduled(out) == {"a": 3}
    assert drafts_of(out) == {"a": [1, 2]}


def test_an_admission_takes_the_last_free_block_before_any_draft():
    scheduler = make_scheduler(num_blocks=6, k=2)
    a, b = make_seq("a", 7), make_seq("b", 9)
    add(scheduler, a, b)
    step(scheduler)
    c = make_seq("c", 3)
    add(scheduler, c)
    out = scheduler.schedule()
    assert scheduled(out) == {"a": 1, "b": 3, "c": 3}
    assert drafts_of(out) == {"b": [3, 4]} and out.preempted == []
    assert len(c.block_table) == 1 and len(a.block_table) == 2


# --- each draft may become an output token: the length caps ---------------------------------


@pytest.mark.parametrize(
    "max_tokens, num_drafts", [(2, 0), (3, 1), (4, 2), (5, 3), (6, 3), (None, 3)]
)
def test_drafts_never_take_a_request_past_max_tokens(max_tokens, num_drafts):
    """After one output token, a step emits at most 1 + drafts more: 2 + drafts <= max_tokens."""
    scheduler = make_scheduler(k=3)
    a = make_seq("a", 8, max_tokens=max_tokens)
    add(scheduler, a)
    step(scheduler)
    out = scheduler.schedule()
    assert len(drafts_of(out).get("a", [])) == num_drafts
    assert scheduled(out) == {"a": 1 + num_drafts}


@pytest.mark.parametrize("max_model_len, num_drafts", [(10, 0), (11, 1), (12, 2), (13, 3), (20, 3)])
def test_drafts_never_take_a_request_past_max_model_len(max_model_len, num_drafts):
    """9 tokens known; with every draft accepted and the bonus token it holds
    10 + drafts tokens, at most ``max_model_len``."""
    scheduler = make_scheduler(k=3, max_model_len=max_model_len)
    a = make_seq("a", 8, max_tokens=None)
    add(scheduler, a)
    step(scheduler)
    out = scheduler.schedule()
    assert len(drafts_of(out).get("a", [])) == num_drafts
    run(scheduler, out)
    assert a.num_tokens == 10 + num_drafts <= max_model_len


def test_the_tightest_cap_wins():
    scheduler = make_scheduler(k=3, max_model_len=12)  # allows 2 drafts
    add(scheduler, make_seq("a", 8, max_tokens=3), make_seq("b", 8, max_tokens=None))
    step(scheduler)
    assert drafts_of(scheduler.schedule()) == {"a": [2], "b": [2, 3]}


# --- verification: roll back what was rejected ----------------------------------------------


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_rejected_drafts_roll_back_num_computed_tokens_and_free_their_blocks(num_accepted):
    """a (8 known tokens, 7 computed, 2 blocks) verifies drafts at positions 8..10 in a
    third block. After the step it has computed its real token and the accepted drafts,
    and holds exactly the blocks those need: the third goes back if all were rejected."""
    scheduler = make_scheduler(num_blocks=16, k=3)
    a = make_seq("a", 7)
    add(scheduler, a)
    step(scheduler)
    out = scheduler.schedule()
    assert drafts_of(out) == {"a": [1, 2, 3]} and len(a.block_table) == 3
    run(scheduler, out, {"a": num_accepted})
    assert a.num_computed_tokens == 8 + num_accepted
    assert len(a.block_table) == (2 if num_accepted == 0 else 3)
    assert scheduler.kv_cache_manager.num_free_blocks == 16 - len(a.block_table)
    assert a.num_uncomputed_tokens == 1  # the correction (or bonus) token, decoded next

    out = scheduler.schedule()  # the rejected positions are computed again, with it
    assert out.chunks[0].start_position == 8 + num_accepted
    assert out.chunks[0].token_ids[0] == a.token_ids[-1]


def test_the_recorded_step_keeps_the_draft_block_after_the_roll_back():
    """The draft rows' block is allocated after the decode's chunk was built; the chunk
    takes the table again then, as its own copy. Rolling the rejected drafts back frees
    that block from the request, not from the record of the step that used it."""
    scheduler = make_scheduler(num_blocks=16, k=3)
    a = make_seq("a", 7)
    add(scheduler, a)
    step(scheduler)
    out = scheduler.schedule()
    [chunk] = out.chunks
    assert list(chunk.block_table) == a.block_table and chunk.block_table is not a.block_table
    assert len(chunk.block_table) == 3  # positions 8..10 are in the third block
    run(scheduler, out, {"a": 0})
    assert len(a.block_table) == 2 and len(chunk.block_table) == 3


def test_the_spec_decode_counters_count_each_verified_run_of_drafts():
    """A verification event per request per step with drafts; position i counts only when
    every draft before it was accepted too. A request without drafts counts nothing."""
    scheduler = make_scheduler(k=3)
    add(scheduler, make_seq("a", 8), make_seq("b", 8))
    step(scheduler)
    step(scheduler, {"a": 3, "b": 1})
    add(scheduler, make_seq("c", 8))
    out = step(scheduler, {"a": 0})
    # b's last token (the correction) never occurred before, and c is a prefill.
    assert drafts_of(out) == {"a": [2, 3, 4]} and scheduled(out) == {"a": 4, "b": 1, "c": 8}
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]


# --- the prefix cache holds only verified tokens --------------------------------------------


def test_an_accepted_draft_enters_the_prefix_cache_once_it_is_a_known_token():
    """a's drafts at positions 7..9 are accepted: the block of positions 4..7 is then full
    of computed tokens, but its last one joins a's tokens only after the step (the output
    processor appends it), so the block is cached one step later."""
    scheduler = make_scheduler(k=3, prefix_caching=True)
    a = make_seq("a", 6)
    add(scheduler, a)
    step(scheduler)
    assert cache_hit(scheduler, cyclic(9)) == 4
    out = scheduler.schedule()
    assert drafts_of(out) == {"a": [4, 1, 2]}
    scheduler.update_from_output(out, ModelRunnerOutput({"a": [4, 1, 2, 3]}))
    assert a.num_computed_tokens == 10 and a.num_tokens == 7
    assert cache_hit(scheduler, cyclic(9)) == 4  # position 7 computed, not known yet
    for token in (4, 1, 2, 3):
        a.append_token(token, now=0.0)
    step(scheduler)
    assert cache_hit(scheduler, cyclic(9)) == 8


def test_a_rejected_draft_never_enters_the_prefix_cache():
    """a drafted 4 1 2 after 1 2 3 4 1 2 3, and the model said 9: the block of positions
    4..7 is cached holding 1 2 3 9, and a prompt continuing with the draft finds only the
    first block."""
    scheduler = make_scheduler(k=3, prefix_caching=True)
    a = make_seq("a", 6)
    add(scheduler, a)
    step(scheduler)
    assert drafts_of(step(scheduler, {"a": 0})) == {"a": [4, 1, 2]}
    assert a.token_ids == cyclic(7) + [CORRECTION] and a.num_computed_tokens == 7
    step(scheduler)  # computes position 7: the block is full of verified tokens now
    assert cache_hit(scheduler, cyclic(9)) == 4
    assert cache_hit(scheduler, cyclic(7) + [CORRECTION, 1]) == 8


def test_every_policy_builds_itself_from_the_settings():
    """The engine's one way in (`EngineConfig.scheduler_cls`, then ``from_config``)."""
    from minivllm.config import EngineConfig
    from minivllm.static_scheduler import StaticBatchScheduler
    from minivllm.utils import resolve_obj_by_qualname

    manager, clock = KVCacheManager(64, block_size=4), lambda: 7.0
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    config = EngineConfig(max_num_seqs=5, max_num_batched_tokens=40, speculative_config=spec)
    scheduler = resolve_obj_by_qualname(config.scheduler_cls).from_config(
        config, manager, 99, clock
    )
    assert type(scheduler) is SpecDecodeScheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (5, 40)
    assert (scheduler.max_model_len, scheduler.clock, scheduler.kv_cache_manager) == (
        99, clock, manager,
    )  # fmt: skip
    proposer = scheduler.proposer
    assert (proposer.k, proposer.min_n, proposer.max_n) == (3, 2, 4)
    assert scheduler.spec_decoding_stats.num_accepted_tokens_per_pos == [0, 0, 0]
    plain = Scheduler.from_config(EngineConfig(max_num_seqs=6), manager, 99, clock)
    assert (type(plain), plain.max_num_seqs, plain.clock) == (Scheduler, 6, clock)
    assert plain.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    static = StaticBatchScheduler.from_config(
        EngineConfig(max_num_seqs=2, scheduling_policy="static"), manager, 32, clock
    )
    assert (static.max_num_seqs, static.max_model_len, static.clock) == (2, 32, clock)
