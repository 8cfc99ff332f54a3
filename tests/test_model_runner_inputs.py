"""The runner's flat batch, exact values: token ids, positions, paged slots, metadata.

No model: `ModelRunner.prepare_inputs` only needs the block size, the device and the
scheduler's decision. The slot of token ``pos`` is
``block_table[pos // block_size] * block_size + pos % block_size``; these cases put chunks
right before, on and after block boundaries, with block tables that are not in order.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.input_batch import InputBatch
from minivllm.model_runner import ModelRunner
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler_output import PAD_TOKEN_ID, ScheduledChunk, SchedulerOutput
from minivllm.sequence import Sequence


def make_runner(block_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # no model, no cache: inputs only
    runner.block_size = block_size
    runner.device = torch.device("cpu")
    runner.input_batch = InputBatch(block_size, runner.device)
    return runner


def running_seq(request_id, token_ids, num_computed, block_table):
    seq = Sequence(request_id, token_ids, SamplingParams(temperature=0))
    seq.num_computed_tokens = num_computed
    seq.block_table = block_table
    return seq


def prepare(runner, chunks, padding=()):
    """``padding``: static batching's (seq, position, rows), after every real chunk."""
    out = SchedulerOutput()
    for seq, num_new in chunks:
        out.add(seq, num_new)
    for seq, position, num_rows in padding:
        out.add_padding(seq, position, num_rows)
    input_ids, positions, metadata = runner.prepare_inputs(out)
    return input_ids.tolist(), positions.tolist(), metadata


def test_a_chunk_that_crosses_a_block_boundary():
    runner = make_runner(block_size=4)
    seq = running_seq("a", list(range(100, 110)), num_computed=3, block_table=[5, 2, 7])
    input_ids, positions, metadata = prepare(runner, [(seq, 6)])  # positions 3 .. 8
    assert input_ids == [103, 104, 105, 106, 107, 108]
    assert positions == [3, 4, 5, 6, 7, 8]
    assert metadata.slot_mapping.tolist() == [5 * 4 + 3, 8, 9, 10, 11, 7 * 4 + 0]
    assert metadata.cu_seqlens_q.tolist() == [0, 6]
    assert metadata.context_lens.tolist() == [9]
    assert metadata.block_tables.tolist() == [[5, 2, 7]]
    assert (metadata.max_query_len, metadata.max_context_len) == (6, 9)


@pytest.mark.parametrize("position, expected_slot", [(3, 15), (4, 0), (7, 3), (8, 24)])
def test_a_decode_at_every_side_of_a_boundary(position, expected_slot):
    """Block table [3, 0, 6] with block_size 4: the last slot of a block, the first of
    the next, the last of that one, the first of the third."""
    runner = make_runner(block_size=4)
    tokens = list(range(1, position + 2))
    table = [3, 0, 6][: position // 4 + 1]
    seq = running_seq("a", tokens, num_computed=position, block_table=table)
    input_ids, positions, metadata = prepare(runner, [(seq, 1)])
    assert (input_ids, positions) == ([tokens[position]], [position])
    assert metadata.slot_mapping.tolist() == [expected_slot]
    assert metadata.context_lens.tolist() == [position + 1]


def test_a_mixed_batch_is_flattened_back_to_back():
    """A decode, a first prefill chunk and a last prefill chunk in one step: each token
    keeps its own sequence's position and block table (padded with block 0)."""
    runner = make_runner(block_size=2)
    decode = running_seq("d", [1, 2, 3, 4, 5], num_computed=4, block_table=[9, 4, 1])
    first = running_seq("f", [6, 7, 8, 9, 10], num_computed=0, block_table=[])
    first.block_table = [3, 8]  # what allocate_slots gave for a 3-token chunk
    last = running_seq("l", [11, 12, 13], num_computed=2, block_table=[5, 6])
    input_ids, positions, metadata = prepare(runner, [(decode, 1), (first, 3), (last, 1)])
    assert input_ids == [5, 6, 7, 8, 13]
    assert positions == [4, 0, 1, 2, 2]
    assert metadata.slot_mapping.tolist() == [1 * 2 + 0, 6, 7, 16, 12]
    assert metadata.cu_seqlens_q.tolist() == [0, 1, 4, 5]
    assert metadata.context_lens.tolist() == [5, 3, 3]
    assert metadata.block_tables.tolist() == [[9, 4, 1], [3, 8, 0], [5, 6, 0]]
    assert (metadata.max_query_len, metadata.max_context_len) == (3, 5)
    # The dtypes AttentionMetadata documents: int32 indices, int64 flat cache slots.
    int32 = (metadata.cu_seqlens_q, metadata.context_lens, metadata.block_tables)
    assert [t.dtype for t in int32] == [torch.int32] * 3
    assert metadata.slot_mapping.dtype == torch.int64


def test_padding_rows_follow_the_real_rows_in_their_members_region():
    """Static batching: padding rows feed PAD_TOKEN_ID at the given positions, in the
    padded member's own blocks, after every real row."""
    runner = make_runner(block_size=4)
    short = running_seq("s", [1, 2], num_computed=0, block_table=[2, 3])
    long = running_seq("l", [4, 5, 6, 7, 8], num_computed=0, block_table=[0, 1])
    padding = [(short, 2, 3)]
    input_ids, positions, metadata = prepare(runner, [(short, 2), (long, 5)], padding)
    assert input_ids == [1, 2, 4, 5, 6, 7, 8] + [PAD_TOKEN_ID] * 3
    assert positions == [0, 1, 0, 1, 2, 3, 4, 2, 3, 4]
    assert metadata.slot_mapping.tolist() == [8, 9, 0, 1, 2, 3, 4, 10, 11, 12]
    assert metadata.cu_seqlens_q.tolist() == [0, 2, 7, 10]
    assert metadata.context_lens.tolist() == [2, 5, 5]
    assert metadata.block_tables.tolist() == [[2, 3], [0, 1], [2, 3]]


# --- which rows are sampled: a fake model whose logits name the row's input token -------------


class EchoModel:
    """hidden state = the input token id; logits favour (that id + 1): so the greedy token
    sampled for a sequence tells which row it was sampled from."""

    vocab_size = 512

    def __call__(self, input_ids, positions, kv_caches, metadata):
        return input_ids.float()[:, None]

    def compute_logits(self, hidden):
        ids = hidden[:, 0].long() + 1
        return torch.nn.functional.one_hot(ids, self.vocab_size).float()


def make_echo_runner(block_size: int) -> ModelRunner:
    from minivllm.sampler import Sampler

    runner = make_runner(block_size)
    runner.model, runner.kv_caches, runner.sampler = EchoModel(), None, Sampler()
    return runner


def sampled(runner: ModelRunner, out: SchedulerOutput) -> dict[str, int]:
    """The one token each sampling request got this step."""
    result = runner.execute_model(out).sampled_token_ids
    assert all(len(tokens) == 1 for tokens in result.values())
    return {request_id: tokens[0] for request_id, tokens in result.items()}


def test_only_chunks_that_reach_the_end_sample_from_their_last_row():
    runner = make_echo_runner(block_size=4)
    finishing = running_seq("f", [10, 11, 12, 13, 14], num_computed=2, block_table=[0, 1])
    midway = running_seq("m", [20, 21, 22, 23, 24], num_computed=0, block_table=[2])
    decode = running_seq("d", [30, 31, 32], num_computed=2, block_table=[3])
    out = SchedulerOutput()
    for seq, num_new in [(finishing, 3), (midway, 2), (decode, 1)]:
        out.add(seq, num_new)
    # midway is mid-prompt: nothing to sample
    assert sampled(runner, out) == {"f": 15, "d": 33}


def test_padding_rows_are_never_sampled():
    runner = make_echo_runner(block_size=4)
    short = running_seq("s", [40], num_computed=0, block_table=[0])
    long = running_seq("l", [50, 51, 52], num_computed=0, block_table=[1])
    out = SchedulerOutput()
    out.add(short, 1)
    out.add(long, 3)
    out.add_padding(short, position=1, num_rows=2)
    assert sampled(runner, out) == {"s": 41, "l": 53}


def test_a_step_where_nobody_samples_returns_nothing():
    runner = make_echo_runner(block_size=4)
    seq = running_seq("m", list(range(1, 9)), num_computed=0, block_table=[0, 1])
    out = SchedulerOutput()
    out.add(seq, 4)
    assert sampled(runner, out) == {}


def test_the_kv_cache_is_allocated_once_for_every_layer_keys_and_values():
    from types import SimpleNamespace

    model = SimpleNamespace(config=SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8))
    runner = ModelRunner(model, num_kv_blocks=5, block_size=4, dtype=torch.float16,
                         device=torch.device("cpu"))  # fmt: skip
    assert runner.kv_caches.shape == (3, 2, 5, 4, 2, 8)  # [layer][k/v][block][slot][head][dim]
    assert runner.kv_caches.dtype == torch.float16
    assert runner.kv_caches.device == torch.device("cpu")
    assert (runner.block_size, runner.device, runner.model) == (4, torch.device("cpu"), model)
    from minivllm.sampler import Sampler

    assert isinstance(runner.sampler, Sampler)


def make_full_echo_runner(eos_token_ids=frozenset()) -> ModelRunner:
    """The echo model behind the runner's own constructor (its sampler and verifier)."""
    from types import SimpleNamespace

    model = EchoModel()
    model.config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
    return ModelRunner(model, num_kv_blocks=4, block_size=4, dtype=torch.float32,
                       device=torch.device("cpu"), eos_token_ids=eos_token_ids)  # fmt: skip


def decoding_seq(request_id, prompt, output_token, **params):
    """A sequence that sampled ``output_token`` last step and now decodes it."""
    seq = Sequence(request_id, prompt, SamplingParams(**({"temperature": 0} | params)))
    seq.append_token(output_token, now=0.0)
    seq.num_computed_tokens = len(prompt)
    seq.block_table = [0, 1]  # room for drafts past the first block
    return seq


def test_a_decode_with_drafts_is_verified_at_its_last_rows_next_to_a_plain_decode():
    """Rows 32 33 34 99 (the real token, then drafts 33 34 99): the echo model's targets
    are 33 34 35 100, so 33 and 34 are accepted and 35 corrects the third draft."""
    runner = make_full_echo_runner()
    spec, plain = decoding_seq("s", [30, 31], 32), decoding_seq("p", [60, 61], 62)
    out = SchedulerOutput()
    out.add(spec, 1)
    out.add_draft_tokens(spec, [33, 34, 99])
    out.add(plain, 1)
    assert runner.execute_model(out).sampled_token_ids == {"s": [33, 34, 35], "p": [63]}


def test_the_runners_sampler_bans_end_of_sequence_before_min_tokens():
    """The echo model favours 41 after 40; 41 is EOS, and the request wants 5 tokens."""
    runner = make_full_echo_runner(eos_token_ids=frozenset({41}))
    out = SchedulerOutput()
    out.add(decoding_seq("r", [39], 40, min_tokens=5), 1)
    out.add(decoding_seq("reached", [39], 40, min_tokens=1), 1)  # its 1 output token counts
    out.add(decoding_seq("free", [39], 40), 1)
    result = runner.execute_model(out).sampled_token_ids
    assert result["free"] == result["reached"] == [41] and result["r"] != [41]


def test_each_seeded_request_samples_from_its_own_generator_whatever_its_batch():
    runner = make_full_echo_runner()

    def sample(seeds):
        out = SchedulerOutput()
        for seed in seeds:
            seq = decoding_seq(f"r{seed}", [39], 40, temperature=1.0, seed=seed)
            seq.generator = torch.Generator().manual_seed(seed)
            out.add(seq, 1)
        return runner.execute_model(out).sampled_token_ids

    together = sample([1, 2, 3, 4])
    assert together == sample([1]) | sample([2]) | sample([3]) | sample([4])
    assert len(set(map(tuple, together.values()))) > 1  # they did sample, not argmax


# --- the persistent batch: what it keeps between steps never changes what it builds --------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_persistent_batch_builds_what_a_fresh_one_would(data):
    """Random steps under the KV-cache manager's rules: requests join, leave, or gain
    blocks at the end of their table; after a step with draft tokens a table may change
    anywhere (rejected drafts' blocks are given back, new ones taken); one that leaves
    and comes back (preempted, or a finished request's id used again) has a new table,
    also when no step ran while it was away. Every table the manager starts or cuts gets
    a new ``block_table_id``. The batch that remembers earlier steps builds exactly the
    tensors of a batch that sees this step alone."""
    block_size = 2
    kept = InputBatch(block_size, torch.device("cpu"), max_num_reqs=2)  # must grow too
    tables: dict[str, list[int]] = {}
    table_ids: dict[str, int] = {}
    next_table_id = itertools.count(1)
    had_drafts: set[str] = set()
    new_table = st.lists(st.integers(0, 99), min_size=1, max_size=40)
    for _ in range(data.draw(st.integers(1, 8))):
        for request_id in "abcdef":
            action = data.draw(st.sampled_from(["keep", "grow", "leave"]))
            if action == "leave":
                tables.pop(request_id, None)
            elif request_id not in tables:  # joins, or comes back
                tables[request_id] = data.draw(new_table)
                table_ids[request_id] = next(next_table_id)
            elif request_id in had_drafts and data.draw(st.booleans()):
                tables[request_id] = data.draw(new_table)  # drafts rejected: anything goes
                table_ids[request_id] = next(next_table_id)
            elif action == "grow":
                tables[request_id] += data.draw(st.lists(st.integers(0, 99), max_size=3))
        had_drafts = set()
        if not tables:
            continue
        out = SchedulerOutput()
        for request_id, table in tables.items():
            capacity = len(table) * block_size
            start = data.draw(st.integers(0, capacity - 1))
            num_new = data.draw(st.integers(1, capacity - start))
            chunk = ScheduledChunk(request_id, list(range(num_new)), start, table, sample=False,
                                   block_table_id=table_ids[request_id])  # fmt: skip
            if num_new > 1 and data.draw(st.booleans()):
                chunk.num_draft_tokens = num_new - 1
                had_drafts.add(request_id)
            out.chunks.append(chunk)
        fresh = InputBatch(block_size, torch.device("cpu"))
        built, expected = kept.prepare(out), fresh.prepare(out)
        for a, b in zip(built[:2], expected[:2]):
            assert a.tolist() == b.tolist()
        for name in ("slot_mapping", "cu_seqlens_q", "context_lens", "block_tables"):
            assert getattr(built[2], name).tolist() == getattr(expected[2], name).tolist()
        assert built[2].block_tables.tolist() == [
            t + [0] * (built[2].block_tables.shape[1] - len(t)) for t in tables.values()
        ]
