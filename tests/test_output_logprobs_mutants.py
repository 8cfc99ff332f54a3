"""The output processor's logprobs bookkeeping, model-free (the engine tests that check
the values against transformers load a checkpoint).

It keeps each asking request's rows as the runner hands them out, gives each token its
text, and reports: every output token's row (DELTA: the new ones), the prompt's rows
(DELTA: once), none after a stop has dropped the step's later tokens; and leaves nothing
behind once a request finishes or is aborted.
"""

from __future__ import annotations

import pytest

from minivllm.output_processor import OutputProcessor
from minivllm.outputs import Logprob, ModelRunnerOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import FinishReason, Sequence
from minivllm.stats import TokenCounts
from tests.test_stop_strings import byte_level_tokenizer

EOS = 0
HE, LL, OH = 257, 282, 79


def make(tokenizer=True, prompt=(HE, LL, OH), **params):
    processor = OutputProcessor(
        byte_level_tokenizer() if tokenizer else None, frozenset({EOS}), 100
    )
    seq = Sequence("r", list(prompt), SamplingParams(**params), prompt="p")
    processor.add_request(seq)
    return processor, seq


def rows(*token_ids):
    return [{t: Logprob(-1.0 - i, rank=1)} for i, t in enumerate(token_ids)]


def step(processor, seq, tokens, prompt=None):
    """One step: the runner's rows for ``tokens`` (and prompt rows), then the tokens."""
    out = ModelRunnerOutput({seq.request_id: tokens})
    if seq.sampling_params.logprobs is not None:
        out.logprobs[seq.request_id] = rows(*tokens)
    if prompt is not None:
        out.prompt_logprobs[seq.request_id] = prompt
    processor.record_logprobs(seq, out)
    stop = processor.append_tokens(seq, tokens, now=1.0)
    if stop is not None:
        seq.finish(stop.reason, 2.0, stop.stop_reason)
    return processor.make_output(seq)


def test_each_output_token_gets_its_row_with_its_text():
    processor, seq = make(logprobs=0, max_tokens=3)
    out = step(processor, seq, [HE])
    [[(token, logprob)]] = [list(r.items()) for r in out.outputs[0].logprobs]
    assert token == HE and logprob.decoded_token == "he" and logprob.logprob == -1.0
    out = step(processor, seq, [LL])
    assert [list(r) for r in out.outputs[0].logprobs] == [[HE], [LL]]
    assert out.prompt_logprobs is None


def test_without_a_tokenizer_the_rows_have_no_text():
    processor, seq = make(tokenizer=False, logprobs=0)
    out = step(processor, seq, [HE])
    assert out.outputs[0].logprobs[0][HE].decoded_token is None


def test_a_delta_output_carries_only_the_new_tokens_rows_and_the_prompt_once():
    processor, seq = make(
        logprobs=0, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA, max_tokens=5
    )
    assert processor.prompt_logprobs["r"] == [None]
    out = step(processor, seq, [HE, LL], prompt=(1, rows(LL, OH)))
    assert [list(r) for r in out.outputs[0].logprobs] == [[HE], [LL]]
    assert out.prompt_logprobs[0] is None and [list(r) for r in out.prompt_logprobs[1:]] == [
        [LL], [OH]
    ]  # fmt: skip
    assert out.prompt_logprobs[1][LL].decoded_token == "ll"
    out = step(processor, seq, [OH])
    assert [list(r) for r in out.outputs[0].logprobs] == [[OH]]
    assert out.prompt_logprobs is None


def test_a_cumulative_output_keeps_reporting_the_prompt_until_the_end():
    processor, seq = make(prompt_logprobs=1, max_tokens=2)
    out = step(processor, seq, [HE], prompt=(1, rows(LL, OH)))
    assert out.outputs[0].logprobs is None and len(out.prompt_logprobs) == 3
    out = step(processor, seq, [LL])
    assert out.finished and len(out.prompt_logprobs) == 3
    assert "r" not in processor.prompt_logprobs


def test_prompt_rows_recomputed_after_a_preemption_are_kept_once():
    processor, seq = make(prompt_logprobs=0, max_tokens=4)
    processor.record_logprobs(seq, ModelRunnerOutput(prompt_logprobs={"r": (1, rows(LL))}))
    processor.record_logprobs(seq, ModelRunnerOutput(prompt_logprobs={"r": (1, rows(LL, OH))}))
    assert [None if r is None else list(r) for r in processor.prompt_logprobs["r"]] == [
        None, [LL], [OH]
    ]  # fmt: skip
    with pytest.raises(AssertionError):  # a gap: rows must arrive in order
        processor.record_logprobs(seq, ModelRunnerOutput(prompt_logprobs={"r": (5, rows(HE))}))


def test_a_stop_drops_the_rows_of_the_tokens_after_it():
    processor, seq = make(logprobs=0, stop_token_ids=[LL])
    out = step(processor, seq, [HE, LL, OH])
    assert out.finished and out.outputs[0].token_ids == [HE, LL]
    assert [list(r) for r in out.outputs[0].logprobs] == [[HE], [LL]]


def test_a_finished_or_aborted_request_leaves_no_logprobs_behind():
    processor, seq = make(logprobs=0, prompt_logprobs=0, max_tokens=1)
    step(processor, seq, [HE], prompt=(1, rows(LL, OH)))
    assert processor.logprobs == {} and processor.prompt_logprobs == {}
    assert processor.stop_token_ids == {}
    processor, seq = make(logprobs=0, prompt_logprobs=0)
    processor.abort_request("r")
    assert processor.logprobs == {} and processor.prompt_logprobs == {}
    assert processor.stop_token_ids == {} and processor.detokenizers == {}


def test_a_request_that_asked_for_neither_gets_none():
    processor, seq = make(max_tokens=2)
    assert processor.logprobs == {} and processor.prompt_logprobs == {}
    out = step(processor, seq, [HE])
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


def test_stop_token_ids_and_eos_stop_only_after_min_tokens_and_eos_not_when_ignored():
    processor, seq = make(stop_token_ids=[LL], min_tokens=2)
    assert processor.stop_token_ids["r"] == frozenset({EOS, LL})
    out = step(processor, seq, [LL])
    assert not out.finished
    out = step(processor, seq, [LL])
    assert out.finished and out.outputs[0].stop_reason == LL
    processor, seq = make(ignore_eos=True, max_tokens=3)
    assert processor.stop_token_ids["r"] == frozenset()
    assert not step(processor, seq, [EOS]).finished
    processor, seq = make()
    out = step(processor, seq, [EOS])
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None and seq.finish_reason is FinishReason.STOP


def test_process_keeps_the_rows_then_the_tokens_and_counts_only_the_new_ones():
    """`process`, the engine's per-request call: logprobs first (output rows alone, or
    prompt rows alone), then the tokens at the step's time, and ``counts`` learns the
    tokens kept this step, not the request's total."""
    processor, seq = make(logprobs=0, max_tokens=5)
    counts = TokenCounts()
    output = ModelRunnerOutput({"r": [HE]}, {"r": rows(HE)})  # output rows, no prompt rows
    assert processor.process(seq, output, 3.0, counts) is None
    assert seq.output_token_ids == [HE] and seq.metrics.token_times == [3.0]
    assert [list(r) for r in processor.logprobs["r"]] == [[HE]]
    assert (counts.num_prompt_tokens, counts.num_generation_tokens) == (3, 1)
    counts = TokenCounts()
    processor.process(seq, ModelRunnerOutput({"r": [LL, OH]}, {"r": rows(LL, OH)}), 4.0, counts)
    assert (counts.num_prompt_tokens, counts.num_generation_tokens) == (0, 2)  # 2 new of 3
    assert seq.metrics.token_times == [3.0, 4.0, 4.0]
    processor, seq = make(prompt_logprobs=0, max_tokens=5)  # prompt rows alone
    output = ModelRunnerOutput({"r": [HE]})
    output.prompt_logprobs["r"] = (1, rows(LL, OH))  # the rows of prompt tokens 1 and 2
    processor.process(seq, output, 1.0, TokenCounts())
    kept = processor.prompt_logprobs["r"]
    assert kept[0] is None and [list(r) for r in kept[1:]] == [[LL], [OH]]
