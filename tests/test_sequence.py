"""One request's state: token bookkeeping, prefill vs decode, timestamps, finishing."""

from __future__ import annotations

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import FinishReason, RequestMetrics, Sequence, SequenceStatus


def make_seq(prompt=(5, 6, 7), arrival_time=10.0):
    return Sequence("r", list(prompt), SamplingParams(), prompt="p", arrival_time=arrival_time)


def test_a_new_sequence_waits_with_nothing_computed():
    seq = make_seq()
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert (seq.num_computed_tokens, seq.num_uncomputed_tokens) == (0, 3)
    assert seq.num_cached_tokens == 0 and seq.block_table == []
    assert seq.prompt == "p" and seq.metrics.arrival_time == 10.0
    assert seq.finish_reason is None and seq.stop_reason is None
    assert repr(seq) == "Sequence('r', waiting, tokens=3, computed=0, blocks=[])"


def test_the_arrival_time_defaults_to_now():
    seq = Sequence("r", [1], SamplingParams())
    later = Sequence("s", [1], SamplingParams())
    assert 0 < seq.metrics.arrival_time <= later.metrics.arrival_time


def test_the_prompt_is_copied_and_outputs_follow_it():
    prompt = [5, 6, 7]
    seq = make_seq(prompt)
    seq.append_token(8, now=11.0)
    seq.append_token(9, now=12.5)
    assert prompt == [5, 6, 7]  # the caller's list is not the sequence's
    assert seq.prompt_token_ids == [5, 6, 7] and seq.output_token_ids == [8, 9]
    assert (seq.num_tokens, seq.num_output_tokens) == (5, 2)
    assert seq.metrics.first_token_time == 11.0  # the first token's time, kept
    assert seq.metrics.token_times == [11.0, 12.5]


def test_prefill_until_the_known_tokens_are_computed_then_decode():
    seq = make_seq([1, 2, 3, 4])
    assert seq.is_prefill
    seq.num_computed_tokens = 3  # a chunk stopped one token short: the last is still prefill
    assert seq.is_prefill and seq.num_uncomputed_tokens == 1
    seq.num_computed_tokens = 4
    seq.append_token(9, now=1.0)
    assert not seq.is_prefill  # one sampled token to compute: a decode
    seq.num_computed_tokens = 0  # preempted: prompt and output are recomputed
    assert seq.is_prefill and seq.num_uncomputed_tokens == 5


def test_finish_records_why_and_when():
    seq = make_seq()
    seq.finish(FinishReason.STOP, now=20.0, stop_reason="###")
    assert seq.is_finished and seq.status is SequenceStatus.FINISHED
    assert seq.finish_reason is FinishReason.STOP and seq.finish_reason.value == "stop"
    assert seq.stop_reason == "###"
    assert seq.metrics.finished_time == 20.0 and seq.metrics.e2e_latency == 10.0


def test_latencies_are_none_until_their_event_happened():
    metrics = RequestMetrics(arrival_time=1.0)
    assert (metrics.queue_time, metrics.ttft, metrics.e2e_latency, metrics.tpot) == (None,) * 4
    metrics.first_scheduled_time = 1.25
    metrics.first_token_time = 2.0
    metrics.token_times = [2.0, 2.5, 4.0]
    assert (metrics.queue_time, metrics.ttft) == (0.25, 1.0)
    assert metrics.tpot is None  # not finished yet
    metrics.finished_time = 4.0
    assert metrics.tpot == (3.0 - 1.0) / 2
    assert metrics.inter_token_latencies == [0.5, 1.5]
