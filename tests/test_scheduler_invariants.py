"""The scheduler and the page allocator never lose a request or a block: stateful tests.

A hypothesis `RuleBasedStateMachine` drives the real `LLMEngine` (its `Scheduler`,
`KVCacheManager`, `BlockAllocator`, input and output processors) and the real
`ModelRunner.prepare_inputs`, through random arrivals (``n > 1`` requests too: children
sharing their prompt's blocks; beam searches: beams forked, sharing blocks copy-on-write,
dropped and preempted; requests that stream (DELTA), report cumulatively or once, with
logprobs and prompt logprobs, whose outputs are checked at their end however often they
were preempted and recomputed), aborts (of a parent: all its children; of a beam search:
all its beams) and steps, with random block
sizes, pool sizes, token budgets, ``max_num_seqs``, and prefix caching on or off. Only the
executor is fake and instant (`FakeExecutor`): what it "writes" into a cache slot is a
fingerprint of the token prefix ending there, and before sampling it reads back every
slot of every scheduled chunk's context through the block table. So a write one slot past
a block, a chunk that reads a stale slot, or a prefix-cache hit on the wrong block fails
at once, without a real model. With speculative decoding on, the fake model accepts a
random prefix of each request's draft tokens, so every step may roll requests back.
It runs each step's block copies (copy-on-write) before its writes, as the real runner
does, so a missing or wrong copy is a stale read; and it gives beams random logprobs.

CI runs the "ci" hypothesis profile (tests/conftest.py); for a longer search run
``HYPOTHESIS_PROFILE=deep pytest tests/test_scheduler_invariants.py``.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from minivllm import LLM, BeamSearchParams, EngineConfig, LLMEngine
from minivllm.input_batch import InputBatch
from minivllm.logprobs import compute_logprobs
from minivllm.model_info import ModelInfo
from minivllm.model_runner import ModelRunner
from minivllm.outputs import ModelRunnerOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.scheduler_output import SchedulerOutput
from minivllm.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.utils import cdiv
from tests.helpers import hf_greedy

EOS = 0
VOCAB = 4  # few distinct tokens: generated text repeats, so blocks get shared


def prefix_fingerprints(token_ids: list[int]) -> list[int]:
    """``result[p]`` names ``token_ids[: p + 1]``: what a real model's K/V at ``p`` depend on."""
    fingerprints, h = [], 0
    for token in token_ids:
        h = hash((h, token))
        fingerprints.append(h)
    return fingerprints


class FakeExecutor(ModelRunner):
    """The executor seam with the real input preparation (positions, slot mapping, block
    tables) and an instant fake model that checks every cache write and read against the
    requests' tokens (which it looks up in the engine: a test's privilege)."""

    def __init__(self, num_blocks: int, block_size: int, rng: random.Random, eos_prob: float):
        # No model and no cache tensors: only what `prepare_inputs` reads.
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.input_batch = InputBatch(block_size, self.device)
        self.num_kv_blocks = num_blocks
        self.max_model_len = num_blocks * block_size  # what the real executor allows at most
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.rng = rng
        self.eos_prob = eos_prob

    def attach(self, engine: LLMEngine) -> None:
        self.requests = engine.scheduler.requests
        self.allocator = engine.kv_cache_manager.allocator
        allocate = self.allocator.allocate

        def allocate_and_record() -> int:
            block_id = allocate()
            self.allocated_this_step.add(block_id)
            return block_id

        self.allocator.allocate = allocate_and_record
        self.begin_step()

    def shutdown(self) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._copy_blocks(scheduler_output.blocks_to_copy)
        input_ids, positions, metadata = self.prepare_inputs(scheduler_output)
        input_ids, positions = input_ids.tolist(), positions.tolist()
        slot_mapping = metadata.slot_mapping.tolist()
        starts = metadata.cu_seqlens_q.tolist()
        sampled, logprobs, prompt_logprobs = {}, {}, {}
        # Like every layer of the real model: the whole step's writes, then the reads (a
        # request admitted in this step may read blocks another one writes in it).
        fingerprints_of = {}
        for i, chunk in enumerate(scheduler_output.chunks):
            seq = self.requests[chunk.request_id]
            # Draft tokens are written like known ones, at the positions after them.
            tokens = seq.token_ids[: chunk.start_position] + chunk.token_ids
            fingerprints_of[i] = fingerprints = prefix_fingerprints(tokens)
            for row in range(starts[i], starts[i + 1]):
                self._write(seq, input_ids[row], positions[row], slot_mapping[row], tokens,
                            fingerprints)  # fmt: skip
        for i, chunk in enumerate(scheduler_output.chunks):
            seq = self.requests[chunk.request_id]
            fingerprints = fingerprints_of[i]
            self._read_context(seq, metadata.block_tables[i].tolist(), fingerprints, chunk)
            assert chunk.sample == (chunk.context_len == seq.num_tokens + chunk.num_draft_tokens)
            if chunk.prompt_logprob_token_ids:  # random rows for the prompt tokens it covers
                targets = chunk.prompt_logprob_token_ids
                prompt_logprobs[seq.request_id] = (chunk.start_position + 1, self._random_rows(
                    targets, chunk.sampling_params.prompt_logprobs))  # fmt: skip
            if chunk.sample:
                # Accept a random prefix of the drafts, then sample one more token.
                num_accepted = self.rng.randint(0, chunk.num_draft_tokens)
                is_eos = self.rng.random() < self.eos_prob
                new_token = EOS if is_eos else self.rng.randrange(1, VOCAB)
                sampled[seq.request_id] = chunk.draft_token_ids[:num_accepted] + [new_token]
                num_top = chunk.sampling_params.logprobs
                if num_top is not None and seq.request_id.startswith("beam"):
                    logits = torch.tensor([[8 * self.rng.random() for _ in range(VOCAB)]])
                    sampled[seq.request_id] = [int(logits.argmax())]
                    logprobs[seq.request_id] = compute_logprobs(
                        logits, sampled[seq.request_id], [min(num_top, VOCAB)]
                    )
                elif num_top is not None:  # asked for logprobs: no drafts, one token
                    assert len(sampled[seq.request_id]) == 1
                    logprobs[seq.request_id] = self._random_rows(sampled[seq.request_id], num_top)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _random_rows(self, targets: list[int], num_top: int):
        logits = torch.tensor([[8 * self.rng.random() for _ in range(VOCAB)] for _ in targets])
        return compute_logprobs(logits, targets, [min(num_top, VOCAB)] * len(targets))

    def _copy_blocks(self, blocks_to_copy):
        """Copy-on-write: every source read before any target is written, as the runner."""
        bs = self.block_size
        contents = [self.slots[src * bs : (src + 1) * bs] for src, _ in blocks_to_copy]
        for (_, dst), content in zip(blocks_to_copy, contents):
            self.slots[dst * bs : (dst + 1) * bs] = content

    def _write(self, seq, token_id, pos, slot, tokens, fingerprints):
        block_id = slot // self.block_size
        assert token_id == tokens[pos]
        assert seq.num_computed_tokens <= pos < len(tokens)
        assert block_id == seq.block_table[pos // self.block_size], "wrote outside own block"
        assert slot % self.block_size == pos % self.block_size
        # A block is written only while it is being filled: it held no registered contents
        # when the step began, or the step took it fresh from the pool. (Registered since
        # the step was scheduled, a sibling admitted in this step may share it already.)
        assert block_id in self.allocated_this_step or block_id not in self.registered_before, (
            "wrote into a full block registered before this step"
        )
        self.slots[slot] = fingerprints[pos]

    def begin_step(self) -> None:
        """Called before each step: remember the registered blocks, watch allocations."""
        self.registered_before = {b for b, h in enumerate(self.allocator.block_hashes) if h}
        self.allocated_this_step = set()

    def _read_context(self, seq, block_table, fingerprints, chunk):
        for pos in range(chunk.context_len):
            block_id = block_table[pos // self.block_size]
            slot = block_id * self.block_size + pos % self.block_size
            assert self.slots[slot] == fingerprints[pos], f"{seq} reads a stale slot at {pos}"


class EngineUnderTest:
    """A real `LLMEngine` on a `FakeExecutor`, plus what the checks need to remember:
    every request's arrival order, the finished ones, the last step's prefix hits."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                 enable_prefix_caching, rng, eos_prob=0.1, speculative_config=None):  # fmt: skip
        config = EngineConfig(
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=speculative_config,
            # The synchronous scheduler's invariants (what holds between two steps); its
            # fake executor fills in no placeholders.
            async_scheduling=False,
        )
        executor = FakeExecutor(num_blocks, block_size, rng, eos_prob)
        # What the engine's front end knows of this model: any id is a prompt token.
        model_info = ModelInfo(SimpleNamespace(vocab_size=1000), None, frozenset({EOS}))
        self.engine = LLMEngine(config, executor=executor, model_info=model_info)
        executor.attach(self.engine)
        self.record_decision_before_update()
        self.scheduler = self.engine.scheduler
        self.kv_cache_manager = self.engine.kv_cache_manager
        self.max_model_len = self.engine.max_model_len
        self.requests = self.scheduler.requests  # the unfinished ones, by id
        self.arrival_order: dict[Sequence, int] = {}
        self.finished: list[Sequence] = []
        self.last_hits: list[Sequence] = []  # admitted by the last step with a prefix hit
        self.children: dict[str, list[Sequence]] = {}  # n > 1: parent id -> its children
        self.beam_searches: dict[str, BeamSearchParams] = {}  # beam search: id -> params
        self.beam_outputs: dict[str, object] = {}  # finished beam searches' outputs
        self.reports: dict[str, list] = {}  # requests with a reporting kind: their outputs

    def record_decision_before_update(self) -> None:
        """Keep a deep copy of each step's decision as the model saw it, taken just before
        `update_from_output` moves the requests on (drafts rolled back, blocks freed)."""
        update_from_output = self.engine.scheduler.update_from_output

        def recording(scheduler_output, model_runner_output):
            self.decision_before_update = decision(scheduler_output)
            update_from_output(scheduler_output, model_runner_output)

        self.engine.scheduler.update_from_output = recording

    def add(
        self, request_id, prompt: list[int], max_tokens: int, min_tokens=0, stop_token_ids=(),
        reporting=None,
    ) -> Sequence:  # fmt: skip
        """``reporting``: None (FINAL_ONLY, no logprobs) or (output kind, logprobs,
        prompt_logprobs); every output of such a request is kept and checked at its end."""
        kind, num_logprobs, num_prompt_logprobs = reporting or (RequestOutputKind.FINAL_ONLY,
                                                                None, None)  # fmt: skip
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            stop_token_ids=list(stop_token_ids),
            output_kind=kind,
            logprobs=num_logprobs,
            prompt_logprobs=num_prompt_logprobs,
        )
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        seq = self.requests[str(request_id)]
        self.arrival_order[seq] = len(self.arrival_order)
        if reporting is not None:
            self.reports[seq.request_id] = []
        return seq

    def add_parallel(self, request_id, prompt: list[int], n: int, max_tokens: int) -> list:
        """An ``n > 1`` request: ``n`` children sharing the prompt. (Greedy: the fake model
        samples on its own, and a chunk holding a torch generator would not compare equal
        to its deep copy in `decision`.)"""
        params = SamplingParams(n=n, temperature=0, seed=n, max_tokens=max_tokens)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        children = [self.requests[f"{i}_{request_id}"] for i in range(n)]
        assert all(child.shares_prompt for child in children)
        for child in children:
            self.arrival_order[child] = len(self.arrival_order)
        self.children[str(request_id)] = children
        return children

    def add_beam_search(self, request_id, prompt: list[int], params: BeamSearchParams) -> None:
        self.engine.add_beam_search_request(request_id, {"prompt_token_ids": prompt}, params)
        self.beam_searches[str(request_id)] = params

    def live_beams(self, request_id: str | None = None) -> list[Sequence]:
        """The live beams of one beam search, or of all."""
        groups = self.engine.request_groups["beam_search"].groups
        chosen = [groups[request_id]] if request_id is not None else groups.values()
        return [beam.seq for group in chosen for beam in group.beams]

    def in_flight(self) -> list[str]:
        """The ids a caller holds: ``n = 1`` requests, parents with a child in flight and
        beam searches."""
        child_ids = {c.request_id for cs in self.children.values() for c in cs}
        child_ids |= set(self.engine.request_groups["beam_search"].group_of)
        parents = [p for p, cs in self.children.items() if not all(c.is_finished for c in cs)]
        searches = list(self.engine.request_groups["beam_search"].groups)
        return sorted(set(self.requests) - child_ids) + sorted(parents) + sorted(searches)

    def abort(self, request_id) -> bool:
        children = self.children.get(str(request_id))
        seqs = [s for s in children if not s.is_finished] if children else []
        if str(request_id) in self.engine.request_groups["beam_search"]:
            seqs = self.live_beams(str(request_id))
        seqs = seqs or [self.requests.get(str(request_id))]
        if not self.engine.abort_request(request_id):
            return False
        self.finished += seqs
        return True

    def step(self) -> SchedulerOutput:
        waiting = set(self.scheduler.waiting)
        beams_before = self.live_beams()
        searches_before = list(self.engine.request_groups["beam_search"].groups)
        self.engine.executor.begin_step()
        outputs = self.engine.step()
        scheduled = self.engine.last_step
        if not scheduled.is_empty:  # the record is a value: the step's end left it alone
            assert decision(scheduled) == self.decision_before_update
        self.last_hits = [
            s for s in scheduled.scheduled_seqs if s in waiting and s.num_cached_tokens
        ]
        beams = set(beams_before)
        done = [s for s in scheduled.scheduled_seqs if s.is_finished and s not in beams]
        # Beam searches report once, after the other requests of the step, when over.
        ended = [r for r in searches_before if r not in self.engine.request_groups["beam_search"]]
        assert [o.request_id for o in outputs if o.finished] == self.reported_ids(done) + ended
        for seq in done:
            check_stop_rules(seq, self.max_model_len)
        for output in outputs:
            if output.request_id in self.reports:
                self.reports[output.request_id].append(output)
            if output.request_id in ended:
                check_beam_output(output, self.beam_searches[output.request_id])
                self.beam_outputs[output.request_id] = output
        for seq in done:
            if seq.request_id in self.reports:
                check_reports(seq, self.reports.pop(seq.request_id))
        self.finished += done
        # Dropped beams are finished; forked ones are new sequences of their search.
        live = set(self.live_beams())
        self.finished += [seq for seq in beams_before if seq not in live]
        for seq in live - beams:
            self.arrival_order[seq] = len(self.arrival_order)
        return scheduled

    def reported_ids(self, done: list[Sequence]) -> list[str]:
        """Who reports finishing, for the sequences ``done`` this step: an ``n = 1``
        request itself; a parent once, when its last child finished."""
        parent_of = {c: p for p, cs in self.children.items() for c in cs}
        ids = []
        for seq in done:
            parent = parent_of.get(seq)
            if parent is None:
                ids.append(seq.request_id)
            elif parent not in ids and all(c.is_finished for c in self.children[parent]):
                ids.append(parent)
        return ids

    def run_to_completion(self, after_step=lambda scheduled: None) -> int:
        """Step until every request finished; returns the number of steps."""
        # The oldest running request is never preempted, and it advances every step, so
        # each request needs at most max_model_len steps once it is the oldest.
        bound = len(self.requests) * self.max_model_len + 1
        for group in self.engine.request_groups["beam_search"].groups.values():  # each decision
            bound += group.params.beam_width * self.max_model_len * (group.max_tokens + 1)
        for num_steps in range(bound):
            if not self.engine.has_unfinished_requests():
                return num_steps
            scheduled = self.step()
            assert not scheduled.is_empty, "a step with unfinished requests did nothing"
            after_step(scheduled)
        raise AssertionError(f"requests still unfinished after {bound} steps: {self.requests}")


def decision(scheduled: SchedulerOutput) -> tuple:
    """Everything a step decided, deep-copied: its chunks (token ids, positions, block
    tables, drafts), its counts, and who was scheduled and preempted."""
    return copy.deepcopy(
        (
            scheduled.chunks,
            scheduled.num_scheduled_tokens,
            scheduled.is_prefill,
            scheduled.scheduled_spec_decode_tokens,
            [seq.request_id for seq in scheduled.scheduled_seqs],
            [seq.request_id for seq in scheduled.preempted],
        )
    )


def check_pool(engine: EngineUnderTest) -> None:
    """Every block is free or owned, and its reference count is its number of owners."""
    allocator = engine.kv_cache_manager.allocator
    owners = [0] * allocator.num_blocks
    for seq in engine.requests.values():
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            owners[block_id] += 1
    assert owners == allocator.ref_counts
    assert set(allocator.free_block_ids) == {b for b, n in enumerate(owners) if n == 0}
    assert allocator.num_free_blocks + allocator.num_used_blocks == allocator.num_blocks
    for block_hash, block_id in allocator.cached_block_ids.items():
        assert allocator.block_hashes[block_id] == block_hash
    if not engine.kv_cache_manager.enable_prefix_caching and not (
        engine.children or engine.beam_searches
    ):
        assert allocator.num_cached_blocks == 0  # only n > 1 siblings and beams hash without it
    for seq in engine.finished:
        assert seq.block_table == [] and seq.is_finished


def check_sequences(engine: EngineUnderTest) -> None:
    """Each sequence holds exactly the blocks its computed tokens need, and the queues are
    in arrival order: running (oldest first) then waiting (first come first served)."""
    block_size = engine.kv_cache_manager.block_size
    scheduler = engine.scheduler
    allocator = engine.kv_cache_manager.allocator
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert 0 < seq.num_computed_tokens <= seq.num_tokens
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, block_size)
        # Only blocks full of computed, known tokens are in the prefix cache: never one
        # holding a rejected draft or a draft not appended yet.
        for i, block_id in enumerate(seq.block_table):
            if allocator.block_hashes[block_id] is not None:
                assert (i + 1) * block_size <= seq.num_computed_tokens
    for seq in scheduler.waiting:
        assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        assert seq.num_computed_tokens == 0 and seq.block_table == []
    # The preempted are counted as they come and go, never by scanning the queue.
    preempted = [s for s in scheduler.waiting if s.status is SequenceStatus.PREEMPTED]
    assert scheduler.num_waiting_preempted == len(preempted)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    in_flight = scheduler.running + list(scheduler.waiting)
    assert set(in_flight) == set(engine.requests.values())
    # Beams join whenever they are forked (as the newest): the order is the others'.
    beams = engine.engine.request_groups["beam_search"].group_of
    arrivals = [engine.arrival_order[seq] for seq in in_flight if seq.request_id not in beams]
    assert arrivals == sorted(arrivals), "a request overtook an earlier one"
    assert set(beams) == {seq.request_id for seq in engine.live_beams()}
    assert set(beams) <= set(engine.requests)  # every live beam is a request in flight


def check_beam_output(output, params: BeamSearchParams) -> None:
    """A finished beam search: at most ``beam_width`` beams, best first by the
    length-penalized score, each with one logprobs dict per token whose chosen entries sum
    to its cum_logprob; EOS only as a last token, and then its finish reason is "stop"."""
    assert 1 <= len(output.outputs) <= params.beam_width and output.finished
    scores = []
    for completion in output.outputs:
        tokens = completion.token_ids
        assert 1 <= len(tokens) <= params.max_tokens
        assert len(completion.logprobs) == len(tokens)
        chosen = sum(row[t].logprob for t, row in zip(tokens, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(chosen, abs=1e-3)
        ends_with_eos = tokens[-1] == EOS and not params.ignore_eos
        assert EOS not in tokens[:-1] or params.ignore_eos
        assert completion.finish_reason == ("stop" if ends_with_eos else "length")
        scores.append(completion.cumulative_logprob / len(tokens) ** params.length_penalty)
    assert scores == sorted(scores, reverse=True) or scores == pytest.approx(
        sorted(scores, reverse=True), abs=1e-3
    )


def check_reports(seq: Sequence, outputs: list) -> None:
    """What a finished request reported, however often it was preempted and recomputed:
    DELTA, each output token once and with it its logprobs row, the prompt's logprobs in
    one output, whole; CUMULATIVE, every output whole so far; FINAL_ONLY, one output."""
    params = seq.sampling_params
    kind, tokens = params.output_kind, seq.output_token_ids
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    completions = [o.outputs[0] for o in outputs]
    if kind is RequestOutputKind.DELTA:
        assert [t for c in completions for t in c.token_ids] == tokens
        rows = [r for c in completions for r in (c.logprobs or [])]
    else:
        assert completions[-1].token_ids == tokens
        rows = completions[-1].logprobs or []
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
    if params.logprobs is not None:
        assert len(rows) == len(tokens) and all(t in row for t, row in zip(tokens, rows))
    if params.prompt_logprobs is not None:
        sent = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        assert len(sent) == (1 if kind is not RequestOutputKind.CUMULATIVE else len(outputs))
        assert len(sent[0]) == seq.num_prompt_tokens and sent[0][0] is None
        for token, row in zip(seq.prompt_token_ids[1:], sent[0][1:]):
            assert token in row
    else:
        assert all(o.prompt_logprobs is None for o in outputs)


def check_stop_rules(seq: Sequence, max_model_len: int) -> None:
    """A request stops at its first EOS or stop token id from ``min_tokens`` on, and
    otherwise runs to its length limit. (The fake model samples EOS whenever it likes: the
    output processor alone must hold it back before ``min_tokens``.)"""
    params, output = seq.sampling_params, seq.output_token_ids
    stops = {EOS, *params.stop_token_ids}
    first_stop = next(
        (i for i, t in enumerate(output) if t in stops and i + 1 >= params.min_tokens), None
    )
    if seq.finish_reason is FinishReason.STOP:
        assert first_stop == len(output) - 1
        assert seq.stop_reason == (None if output[-1] == EOS else output[-1])
    else:
        assert seq.finish_reason is FinishReason.LENGTH
        assert first_stop is None
        assert len(output) == params.max_tokens or seq.num_tokens >= max_model_len


def check_step(engine: EngineUnderTest, scheduled: SchedulerOutput) -> None:
    scheduler = engine.scheduler
    assert scheduled.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert scheduled.num_rows == scheduled.total_num_scheduled_tokens  # nothing wasted
    assert len(scheduled.scheduled_seqs) <= scheduler.max_num_seqs
    assert len(set(scheduled.scheduled_seqs)) == len(scheduled.scheduled_seqs)
    assert all(n >= 1 for n in scheduled.num_scheduled_tokens.values())
    # Nobody is preempted and readmitted in one step, but when every sequence still
    # running is an idle beam: they are preempted until the head of the queue is admitted.
    if set(scheduled.scheduled_seqs) & set(scheduled.preempted):
        assert any(seq.request_id.startswith("beam") for seq in scheduled.preempted)


# One request: (which shared prefix or None, how much of it, random suffix length,
# max_tokens, min_tokens, stop token ids).
REQUEST = st.tuples(
    st.sampled_from([None, 0, 1]),
    st.sampled_from([0, 3, 8, 13, 20]),
    st.integers(0, 12),
    st.integers(1, 16),
    st.sampled_from([0, 0, 2, 5]),
    st.sampled_from([(), (), (1,), (2, 3)]),
    # How it reports: see EngineUnderTest.add (DELTA: streamed, as over HTTP).
    st.sampled_from(
        [
            None,
            (RequestOutputKind.DELTA, None, 1),
            (RequestOutputKind.DELTA, 1, 0),
            (RequestOutputKind.DELTA, 2, 2),
            (RequestOutputKind.CUMULATIVE, 1, 1),
            (RequestOutputKind.FINAL_ONLY, None, 2),
        ]
    ),
)
# Requests the engine must refuse, leaving everything as it was.
BAD_REQUEST = st.sampled_from(
    [
        ({"prompt_token_ids": [1, True]}, {}),
        ({"prompt_token_ids": [1, 2.5]}, {}),
        ({"prompt_token_ids": []}, {}),
        ({"prompt_token_ids": [1]}, {"top_k": True}),
        ({"prompt_token_ids": [1]}, {"max_tokens": 2.5}),
        ({"prompt_token_ids": [1]}, {"seed": 2**64, "temperature": 1.0}),
        ({"prompt_token_ids": [1]}, {"stop_token_ids": [False]}),
    ]
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        # sampled_from rather than integers: hypothesis favours the small end of a range,
        # and a pool of one block or a single sequence never preempts anything. A pool of
        # about one or two requests' worth of tokens preempts most.
        block_size=st.sampled_from([1, 2, 3, 4, 8]),
        pool_tokens=st.sampled_from([4, 8, 16, 24, 32, 48]),
        max_num_seqs=st.sampled_from([1, 2, 3, 4, 6]),
        max_num_batched_tokens=st.sampled_from([1, 2, 3, 5, 8, 16, 40]),
        enable_prefix_caching=st.booleans(),
        eos_prob=st.sampled_from([0.0, 0.05, 0.3]),
        # Speculative decoding: None (off) or (num_speculative_tokens, lookup min, max).
        speculative=st.sampled_from([None, None, (1, 1, 1), (3, 1, 2), (5, 2, 3)]),
        rng=st.randoms(use_true_random=False),
        first_requests=st.lists(REQUEST, min_size=2, max_size=8),
    )
    def setup(self, block_size, pool_tokens, max_num_seqs, max_num_batched_tokens,
              enable_prefix_caching, eos_prob, speculative, rng, first_requests):  # fmt: skip
        num_blocks = max(1, pool_tokens // block_size)
        speculative_config = None
        if speculative is not None:
            k, lookup_min, lookup_max = speculative
            speculative_config = {"num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
                                  "prompt_lookup_max": lookup_max}  # fmt: skip
        self.engine = EngineUnderTest(num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                 enable_prefix_caching, rng, eos_prob,
                                 speculative_config)  # fmt: skip
        self.rng = rng
        # A few "system prompts" that many requests start with, so prefixes are shared.
        self.shared_prefixes = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(2)]
        self.num_added = 0
        self.add_requests(first_requests)

    @rule(requests=st.lists(REQUEST, min_size=1, max_size=4))
    def add_requests(self, requests):
        for (
            shared_prefix,
            prefix_len,
            suffix_len,
            max_tokens,
            min_tokens,
            stops,
            reporting,
        ) in requests:
            prefix = [] if shared_prefix is None else self.shared_prefixes[shared_prefix]
            prompt = prefix[:prefix_len] + [self.rng.randrange(VOCAB) for _ in range(suffix_len)]
            # What the input processor accepts: 1 .. max_model_len tokens.
            prompt = (prompt or [1])[: self.engine.max_model_len]
            # Ids are ints: the engine keeps them as str, and abort takes either.
            self.engine.add(self.num_added, prompt, max_tokens, min_tokens, stops, reporting)
            self.num_added += 1

    @rule(
        shared_prefix=st.sampled_from([None, 0, 1]),
        suffix_len=st.integers(1, 12),
        n=st.integers(2, 4),
        max_tokens=st.integers(1, 12),
    )
    def add_parallel_request(self, shared_prefix, suffix_len, n, max_tokens):
        """Parallel sampling: one parent, ``n`` children sharing the prompt's blocks."""
        prefix = [] if shared_prefix is None else self.shared_prefixes[shared_prefix]
        prompt = prefix + [self.rng.randrange(VOCAB) for _ in range(suffix_len)]
        prompt = prompt[: self.engine.max_model_len]
        if n > self.engine.scheduler.max_num_seqs:  # refused, leaving everything as it was
            before = (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks)
            with pytest.raises(ValueError, match="max_num_seqs"):
                self.engine.add_parallel(self.num_added, prompt, n, max_tokens)
            after = (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks)
            assert after == before
            return
        self.engine.add_parallel(self.num_added, prompt, n, max_tokens)
        self.num_added += 1

    @rule(
        shared_prefix=st.sampled_from([None, 0, 1]),
        suffix_len=st.integers(1, 12),
        beam_width=st.integers(1, 4),
        max_tokens=st.integers(1, 10),
        ignore_eos=st.booleans(),
        length_penalty=st.sampled_from([1.0, 0.0, 2.0]),
    )
    def add_beam_search(
        self, shared_prefix, suffix_len, beam_width, max_tokens, ignore_eos, length_penalty
    ):
        """Beam search: beams forked (sharing blocks, copy-on-write) and dropped."""
        prefix = [] if shared_prefix is None else self.shared_prefixes[shared_prefix]
        prompt = prefix + [self.rng.randrange(VOCAB) for _ in range(suffix_len)]
        prompt = prompt[: self.engine.max_model_len]
        params = BeamSearchParams(beam_width, max_tokens, ignore_eos, 0.0, length_penalty)
        if beam_width > self.engine.scheduler.max_num_seqs:  # refused, nothing changes
            before = (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks)
            with pytest.raises(ValueError, match="max_num_seqs"):
                self.engine.add_beam_search(self.num_added, prompt, params)
            after = (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks)
            assert after == before
            return
        self.engine.add_beam_search(self.num_added, prompt, params)
        for seq in self.engine.live_beams(str(self.num_added)):
            self.engine.arrival_order[seq] = len(self.engine.arrival_order)
        self.num_added += 1

    @rule(bad=BAD_REQUEST)
    def add_bad_request(self, bad):
        prompt, kwargs = bad
        engine = self.engine.engine
        before = (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks)
        with pytest.raises(ValueError):
            engine.add_request("bad", prompt, SamplingParams(**kwargs))
        assert (set(self.engine.requests), self.engine.kv_cache_manager.num_free_blocks) == before

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        """Abort an ``n = 1`` request, a parent (every child of it still in flight) or a
        beam search (every live beam)."""
        request_id = data.draw(st.sampled_from(self.engine.in_flight()))
        children = self.engine.children.get(request_id)
        seqs = [s for s in children if not s.is_finished] if children else []
        if request_id in self.engine.engine.request_groups["beam_search"]:
            seqs = self.engine.live_beams(request_id)
        seqs = seqs or [self.engine.requests[request_id]]
        request_id = data.draw(st.sampled_from([request_id, int(request_id)]))
        allocator = self.engine.kv_cache_manager.allocator
        # Blocks nobody else holds come back at once, shared ones among siblings included.
        holders = Counter(b for seq in seqs for b in seq.block_table)
        num_private = sum(allocator.ref_counts[b] == n for b, n in holders.items())
        num_free = allocator.num_free_blocks
        assert self.engine.abort(request_id)
        for seq in seqs:
            assert seq.finish_reason is FinishReason.ABORT and seq.block_table == []
        assert allocator.num_free_blocks == num_free + num_private  # returned at once
        assert not self.engine.abort(request_id)  # a second abort is a no-op

    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._check_after_step(self.engine.step())

    def _check_after_step(self, scheduled):
        check_step(self.engine, scheduled)
        check_pool(self.engine)
        check_sequences(self.engine)
        self._record_events(scheduled)

    def _record_events(self, scheduled):
        """What the search reached (``pytest --hypothesis-show-statistics``; `REACHED`)."""
        if scheduled.preempted:
            event("preemption")
            REACHED["preemption"] += 1
        if scheduled.scheduled_spec_decode_tokens:
            event("draft tokens verified")
        if any(
            scheduled.is_prefill[s.request_id] and s.num_uncomputed_tokens > 1
            for s in scheduled.scheduled_seqs
        ):
            REACHED["chunked prefill"] += 1
        for seq in self.engine.last_hits:
            event("prefix hit" + (" after a preemption" if seq.metrics.num_preemptions else ""))
            is_beam = seq.request_id.startswith("beam")  # beams hash too: not siblings
            if seq.shares_prompt and not seq.metrics.num_preemptions and not is_beam:
                REACHED["sibling shares the prompt"] += 1
        beams = self.engine.engine.request_groups["beam_search"].group_of
        if any(seq.shares_prompt and seq.request_id not in beams for seq in scheduled.preempted):
            REACHED["child preempted"] += 1
        if any(seq.request_id in beams for seq in scheduled.preempted):
            REACHED["beam preempted"] += 1
        delta = RequestOutputKind.DELTA
        if any(
            s.sampling_params.output_kind is delta
            and s.sampling_params.prompt_logprobs is not None
            and s.num_output_tokens > 0  # its prompt's logprobs went out: recomputed now
            for s in scheduled.preempted
        ):
            REACHED["streamed request with prompt logprobs preempted"] += 1
        if scheduled.blocks_to_copy:
            event("copy-on-write")
            REACHED["copy-on-write"] += 1
        if self.engine.beam_outputs:
            REACHED["beam search finished"] += 1

    @rule()
    def run_to_completion(self):
        self.engine.run_to_completion(after_step=self._check_after_step)
        allocator = self.engine.kv_cache_manager.allocator
        # Everything is back in the pool (cached blocks stay, but are evictable).
        assert allocator.num_free_blocks == allocator.num_blocks
        assert allocator.ref_counts == [0] * allocator.num_blocks
        assert all(seq.finish_reason is not None for seq in self.engine.finished)

    @invariant()
    def pool_and_queues_are_consistent(self):
        check_pool(self.engine)
        check_sequences(self.engine)

    def teardown(self):
        if hasattr(self, "engine"):
            self.run_to_completion()


# Derandomized: the same examples every run, so the test below can promise what they reach.
# 90 examples, not the profile's 30: with 30, the streamed-and-preempted request with prompt
# logprobs and copy-on-write were each missed by some run (alone vs. in the full suite).
SchedulerMachine.TestCase.settings = settings(
    max_examples=90, stateful_step_count=60, derandomize=True
)
REACHED: Counter[str] = Counter()


def test_scheduler_machine():
    """The state machine, and proof that its examples reached preemption and chunking."""
    REACHED.clear()
    run_state_machine_as_test(SchedulerMachine, settings=SchedulerMachine.TestCase.settings)
    assert REACHED["preemption"] > 0 and REACHED["chunked prefill"] > 0, REACHED
    assert REACHED["sibling shares the prompt"] > 0, REACHED
    assert REACHED["copy-on-write"] > 0 and REACHED["beam search finished"] > 0, REACHED
    assert REACHED["streamed request with prompt logprobs preempted"] > 0, REACHED
    # A preempted child is reached by most runs but not all (one full-suite run saw none),
    # so it is pinned down deterministically instead: test_parallel_sampling.py's
    # test_preempting_children_never_corrupts_a_siblings_shared_blocks.


# --- bugs other small engines shipped, as explicit regression tests ---------------------------
# The fake model checks every write and read, so each test only has to reach the situation.


@pytest.mark.parametrize(
    "block_size, prompt_len", [(b, n) for b in (1, 2, 4) for n in range(1, 3 * b + 2)]
)
def test_decode_writes_stay_in_their_block_at_every_block_boundary(block_size, prompt_len):
    """nano-vllm #30, #150, #240: at a block boundary the newest token's K/V went one slot
    past the allocated block. Every prompt length around a boundary; two requests share an
    exactly-sized pool, so a stray write lands in the other request's block."""
    max_tokens = 2 * block_size + 1
    num_blocks = 2 * cdiv(prompt_len + max_tokens, block_size)
    engine = EngineUnderTest(num_blocks, block_size, 2, 64, False, random.Random(0), eos_prob=0)
    first = engine.add("a", list(range(1, prompt_len + 1)), max_tokens)
    second = engine.add("b", list(range(2, prompt_len + 2)), max_tokens)
    engine.run_to_completion(after_step=lambda _: check_sequences(engine))
    assert first.num_output_tokens == second.num_output_tokens == max_tokens
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_a_100_percent_prefix_hit_still_computes_the_last_block(num_blocks_in_prompt):
    """nano-vllm #114: a prompt whose every block is cached crashed (nothing to compute)."""
    block_size = 4
    prompt = list(range(1, block_size * num_blocks_in_prompt + 1))
    engine = EngineUnderTest(16, block_size, 2, 64, True, random.Random(0), eos_prob=0)
    engine.add("first", prompt, 3)
    engine.run_to_completion()
    again = engine.add("again", prompt, 3)
    scheduled = engine.step()
    assert again in engine.last_hits or num_blocks_in_prompt == 1
    assert again.num_cached_tokens == (num_blocks_in_prompt - 1) * block_size
    assert list(scheduled.num_scheduled_tokens.values()) == [block_size]  # the last block
    engine.run_to_completion()
    assert again.num_output_tokens == 3


def test_a_prefix_hit_right_after_a_preemption():
    """nano-vllm PR #211: a request readmitted after preemption hit the cache and went out
    of bounds. Three requests with a shared prefix in a pool that holds two."""
    engine = EngineUnderTest(6, 2, 4, 8, True, random.Random(0), eos_prob=0)
    shared = [5, 6, 7, 8]
    requests = [engine.add(name, shared + [i], 6) for i, name in enumerate("abc", start=1)]
    readmitted_with_hit = []
    engine.run_to_completion(
        after_step=lambda _: readmitted_with_hit.extend(
            seq for seq in engine.last_hits if seq.metrics.num_preemptions
        )
    )
    assert readmitted_with_hit
    assert all(seq.num_output_tokens == 6 for seq in requests)
    assert engine.kv_cache_manager.num_free_blocks == 6


@pytest.mark.parametrize("chunk_blocks", [1, 2])
@pytest.mark.parametrize("num_chunks, extra_tokens", [(1, 0), (1, 1), (2, 0), (2, 3)])
def test_chunked_prefill_ending_exactly_on_a_block_boundary(chunk_blocks, num_chunks, extra_tokens):
    """nano-vllm PRs #207, #213, #217, #233: a prefill chunk ending on (or off) a block
    boundary wrote or read the wrong slots. A budget of whole blocks, prompts around it."""
    block_size = 4
    budget = chunk_blocks * block_size
    prompt_len = num_chunks * budget + extra_tokens
    engine = EngineUnderTest(32, block_size, 2, budget, False, random.Random(0), eos_prob=0)
    seq = engine.add("a", list(range(1, prompt_len + 1)), 4)
    chunks = []
    engine.run_to_completion(
        after_step=lambda scheduled: chunks.append(list(scheduled.num_scheduled_tokens.values()))
    )
    expected = [[min(budget, prompt_len - start)] for start in range(0, prompt_len, budget)]
    assert chunks[: len(expected)] == expected
    assert seq.num_output_tokens == 4


# --- the same situations through the real engine and a tiny real model -----------------------


@pytest.fixture(scope="module")
def hf_tiny_llama(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)


@pytest.mark.parametrize("block_size", [2, 4])
def test_engine_matches_transformers_across_block_boundaries(
    tiny_llama_path, hf_tiny_llama, block_size
):
    """Decodes that cross block boundaries, prefill chunks that end on one, prefix hits:
    greedy tokens must equal transformers' for every prompt length around a boundary."""
    params = SamplingParams(temperature=0, max_tokens=2 * block_size + 1, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in range(block_size - 1, 2 * block_size + 2)]
    llm = LLM(
        str(tiny_llama_path),
        block_size=block_size,
        max_num_batched_tokens=2 * block_size,  # chunks of whole blocks
        enable_prefix_caching=True,  # the prompts share prefixes
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_tiny_llama, prompt, params.max_tokens)


def test_a_streamed_request_with_prompt_logprobs_survives_recompute():
    """A DELTA request hands its prompt logprobs out with its first output; preempted
    after that, its recomputed prompt gives the rows again. They were looked up in the
    dict the hand-out had emptied: KeyError out of engine.step(), the step half-done."""
    engine = EngineUnderTest(6, 2, 2, 64, False, random.Random(0), eos_prob=0)
    reporting = (RequestOutputKind.DELTA, 1, 1)
    seqs = [engine.add(i, [1, 2, 3, 1], 8, reporting=reporting) for i in range(2)]
    engine.run_to_completion(after_step=lambda _: check_sequences(engine))
    assert engine.scheduler.num_preemptions > 0
    assert any(s.metrics.num_preemptions for s in seqs)
    assert [s.num_output_tokens for s in seqs] == [8, 8]
    assert engine.reports == {}  # each was checked at its end (check_reports)
