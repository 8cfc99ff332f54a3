"""The runner's parts added for async scheduling and logprobs, model-free: the echo model
of test_model_runner_inputs.py (logits favour the row's input id + 1) behind the real
`ModelRunner`, so each sampled token and each logprob row names the row it came from.
"""

from __future__ import annotations

import math

from minivllm.sampling_params import SamplingParams
from minivllm.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from minivllm.sequence import Sequence
from tests.test_model_runner_inputs import decoding_seq, make_full_echo_runner

# The echo model's one-hot logits over 512 tokens: the favoured token's logprob, and the
# others'.
TOP = -math.log(math.e + 511) + 1
REST = -math.log(math.e + 511)


def prefill_seq(request_id, prompt, **params):
    seq = Sequence(request_id, prompt, SamplingParams(**({"temperature": 0} | params)))
    seq.block_table = [0, 1]
    return seq


def test_a_placeholder_input_is_the_last_steps_sample():
    runner = make_full_echo_runner()
    first = SchedulerOutput()
    first.add(decoding_seq("d", [30, 31], 32), 1)
    first.add(decoding_seq("p", [40, 41], 42, repetition_penalty=1.5), 1)
    assert runner.execute_model(first).sampled_token_ids == {"d": [33], "p": [43]}
    assert runner.prev_sampled_token_ids == {"d": 33, "p": 43}

    # The next step was scheduled before 33 and 43 were known: placeholders.
    second = SchedulerOutput()
    for request_id, prompt, token, params in [
        ("d", [30, 31], 32, {}), ("p", [40, 41], 42, {"repetition_penalty": 1.5})
    ]:  # fmt: skip
        seq = decoding_seq(request_id, prompt, token, **params)
        seq.num_computed_tokens += 1
        seq.num_output_placeholders = 1
        second.add(seq, 1)
    assert [c.token_ids for c in second.chunks] == [[PLACEHOLDER_TOKEN_ID]] * 2
    penalized = []
    sampler = runner.sampler
    runner.sampler = lambda logits, chunks: penalized.extend(chunks) or sampler(logits, chunks)
    assert runner.execute_model(second).sampled_token_ids == {"d": [34], "p": [44]}
    # The runner filled the inputs in its own copies: the step record is the scheduler's.
    assert [c.token_ids for c in second.chunks] == [[PLACEHOLDER_TOKEN_ID]] * 2
    assert [c.output_token_ids for c in second.chunks] == [[], [42]]
    # For penalties the sampler counts the outputs so far, 43 included: it gets a copy of
    # that chunk; without penalties it gets the record's own chunk.
    assert penalized[0] is second.chunks[0] and penalized[0].output_token_ids == []
    assert penalized[1] is not second.chunks[1] and penalized[1].output_token_ids == [42, 43]
    assert runner.prev_sampled_token_ids == {"d": 34, "p": 44}


def test_logprobs_come_for_the_rows_that_asked_only():
    runner = make_full_echo_runner()
    out = SchedulerOutput()
    out.add(decoding_seq("plain", [10], 11), 1)
    out.add(decoding_seq("asks", [20], 21, logprobs=2), 1)
    result = runner.execute_model(out)
    assert result.sampled_token_ids == {"plain": [12], "asks": [22]}
    [row] = result.logprobs["asks"]
    assert list(result.logprobs) == ["asks"]
    assert list(row)[:2] == [22, 0]  # the sampled token, then the top ones (22, then id 0)
    assert math.isclose(row[22].logprob, TOP, rel_tol=1e-5) and row[22].rank == 1
    assert math.isclose(row[0].logprob, REST, rel_tol=1e-5)


def test_prompt_logprobs_come_from_the_prompt_rows_and_the_sample_from_the_last():
    runner = make_full_echo_runner()
    out = SchedulerOutput()
    other = prefill_seq("other", [50, 51])
    out.add(other, 2)
    seq = prefill_seq("r", [10, 11, 20], prompt_logprobs=0, logprobs=0)
    out.add(seq, 3)
    result = runner.execute_model(out)
    assert result.sampled_token_ids == {"other": [52], "r": [21]}
    start, rows = result.prompt_logprobs["r"]
    assert start == 1 and [list(r) for r in rows] == [[11], [20]]
    assert rows[0][11].rank == 1 and math.isclose(rows[0][11].logprob, TOP, rel_tol=1e-5)
    assert rows[1][20].rank == 2 and math.isclose(rows[1][20].logprob, REST, rel_tol=1e-5)
    assert list(result.prompt_logprobs) == ["r"] and list(result.logprobs) == ["r"]


def test_a_mid_prompt_chunk_gives_its_prompt_logprobs_without_sampling():
    runner = make_full_echo_runner()
    seq = prefill_seq("r", [10, 11, 12, 30, 31], prompt_logprobs=1)
    seq.num_computed_tokens = 1
    out = SchedulerOutput()
    out.add(seq, 2)  # rows at 11, 12 predict 12 and 30
    result = runner.execute_model(out)
    assert result.sampled_token_ids == {}
    start, rows = result.prompt_logprobs["r"]
    assert start == 2 and [list(r)[0] for r in rows] == [12, 30]
    assert rows[0][12].rank == 1 and rows[1][30].rank == 2
    assert list(rows[1]) == [30, 13]  # and its top one: the echo's favourite


def test_a_decode_with_drafts_next_to_a_plain_decode_asking_for_logprobs():
    runner = make_full_echo_runner()
    spec, plain = decoding_seq("s", [30, 31], 32), decoding_seq("p", [60, 61], 62, logprobs=0)
    out = SchedulerOutput()
    out.add(spec, 1)
    out.add_draft_tokens(spec, [33, 34, 99])
    out.add(plain, 1)
    result = runner.execute_model(out)
    assert result.sampled_token_ids == {"s": [33, 34, 35], "p": [63]}
    assert list(result.logprobs) == ["p"] and list(result.logprobs["p"][0]) == [63]
    assert result.logprobs["p"][0][63].rank == 1


def test_requests_asking_for_prompt_logprobs_in_one_step_get_their_own_rows():
    runner = make_full_echo_runner()
    out = SchedulerOutput()
    a = prefill_seq("a", [10, 11, 12], prompt_logprobs=0)
    b = prefill_seq("b", [40, 41, 50, 51], prompt_logprobs=0)
    b.block_table = [2, 3]
    c = prefill_seq("c", [70, 80], prompt_logprobs=0)
    c.block_table = [3]
    out.add(a, 3)
    out.add(b, 4)
    out.add(c, 2)
    result = runner.execute_model(out)
    assert {r: [list(row) for row in rows] for r, (_, rows) in result.prompt_logprobs.items()} == {
        "a": [[11], [12]], "b": [[41], [50], [51]], "c": [[80]]
    }  # fmt: skip
    assert [row[50].rank for row in result.prompt_logprobs["b"][1][1:2]] == [2]


def test_the_model_gets_the_steps_positions_the_kv_cache_and_the_metadata():
    runner = make_full_echo_runner()
    calls = []
    echo = runner.model

    class Recording:
        config = echo.config

        def __call__(self, input_ids, positions, kv_caches, metadata):
            calls.append((positions.tolist(), kv_caches, metadata))
            return echo(input_ids, positions, kv_caches, metadata)

        def compute_logits(self, hidden):
            return echo.compute_logits(hidden)

    runner.model = Recording()
    out = SchedulerOutput()
    out.add(decoding_seq("d", [30, 31], 32), 1)
    out.add(prefill_seq("p", [5, 6, 7]), 3)
    assert runner.execute_model(out).sampled_token_ids == {"d": [33], "p": [8]}
    [(positions, kv_caches, metadata)] = calls
    assert positions == [2, 0, 1, 2] and kv_caches is runner.kv_caches
    assert metadata.cu_seqlens_q.tolist() == [0, 1, 4]
    assert metadata.context_lens.tolist() == [3, 3]


def test_a_decode_with_drafts_between_two_plain_decodes_is_read_at_its_own_rows():
    runner = make_full_echo_runner()
    first, spec, last = (decoding_seq("a", [10], 11), decoding_seq("s", [30, 31], 32),
                         decoding_seq("z", [60], 61))  # fmt: skip
    out = SchedulerOutput()
    out.add(first, 1)
    out.add(spec, 1)
    out.add_draft_tokens(spec, [33, 99])
    out.add(last, 1)
    assert runner.execute_model(out).sampled_token_ids == {"a": [12], "s": [33, 34], "z": [62]}


def test_a_seeded_request_verifies_its_drafts_with_its_own_generator():
    import torch

    runner = make_full_echo_runner()

    def verify(seed, global_seed):
        torch.manual_seed(global_seed)  # what the batch-mates' draws would move
        seq = decoding_seq("s", [30, 31], 32, temperature=1.0, seed=seed)
        seq.generator = torch.Generator().manual_seed(seed)
        out = SchedulerOutput()
        out.add(seq, 1)
        out.add_draft_tokens(seq, [77, 78, 79])
        return runner.execute_model(out).sampled_token_ids["s"]

    assert verify(1, global_seed=0) == verify(1, global_seed=1) == verify(1, global_seed=2)
    assert len({tuple(verify(s, global_seed=0)) for s in range(4)}) > 1  # it does sample


def test_a_placeholder_after_a_chunk_with_known_inputs_is_filled_too():
    runner = make_full_echo_runner()
    first = SchedulerOutput()
    first.add(decoding_seq("d", [30, 31], 32), 1)
    runner.execute_model(first)
    second = SchedulerOutput()
    second.add(prefill_seq("p", [5, 6]), 2)  # known inputs: nothing to fill
    seq = decoding_seq("d", [30, 31], 32)
    seq.num_computed_tokens += 1
    seq.num_output_placeholders = 1
    second.add(seq, 1)
    assert runner.execute_model(second).sampled_token_ids == {"p": [7], "d": [34]}
