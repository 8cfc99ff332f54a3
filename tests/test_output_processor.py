"""The output processor's other rules, with no model: length stops, EOS, several tokens in
one step (speculative decoding), what each output kind reports, and no tokenizer.

Stop strings and streaming are in test_stop_strings.py; these tests use the same trained
byte-level tokenizer, with words spelled by its own token ids ("hello world" is
``he ll o ␣ wor ld``).
"""

from __future__ import annotations

import pytest

from minivllm.output_processor import OutputProcessor
from minivllm.outputs import Logprob, ModelRunnerOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import FinishReason, Sequence
from tests.test_stop_strings import _split_into_bytes, byte_level_tokenizer

EOS = 0  # the tokenizer's <eos>
HE, LL, OH, SPACE, WOR, LD = 257, 282, 79, 221, 295, 281


def make(params: SamplingParams, max_model_len=100, tokenizer=True, prompt=(5, 6)):
    processor = OutputProcessor(
        byte_level_tokenizer() if tokenizer else None, frozenset({EOS}), max_model_len
    )
    seq = Sequence("r", list(prompt), params, prompt="the prompt")
    processor.add_request(seq)
    return processor, seq


def feed(processor: OutputProcessor, seq: Sequence, token_ids: list[int]):
    """One step that sampled ``token_ids``; finishes ``seq`` if they stop it (the engine's job)."""
    stop = processor.append_tokens(seq, token_ids, now=1.0)
    if stop is not None:
        seq.finish(stop.reason, 2.0, stop.stop_reason)
    return stop


def test_the_token_ids_spell_hello_world():
    assert byte_level_tokenizer()("hello world").input_ids == [HE, LL, OH, SPACE, WOR, LD]


# --- when a request stops -------------------------------------------------------------------


def test_max_tokens_ends_a_request_by_length_at_its_last_token():
    processor, seq = make(SamplingParams(max_tokens=3))
    assert feed(processor, seq, [HE]) is None
    assert feed(processor, seq, [LL]) is None
    stop = feed(processor, seq, [OH])
    assert (stop.reason, stop.stop_reason) == (FinishReason.LENGTH, None)
    assert processor.make_output(seq).outputs[0].text == "hello"


def test_max_model_len_ends_a_request_by_length():
    """Prompt 2 tokens, max_model_len 4: the second output token is the last."""
    processor, seq = make(SamplingParams(max_tokens=None), max_model_len=4)
    assert feed(processor, seq, [HE]) is None
    assert feed(processor, seq, [LL]).reason is FinishReason.LENGTH


def test_eos_stops_without_a_stop_reason_unless_ignored():
    processor, seq = make(SamplingParams(max_tokens=10))
    stop = feed(processor, seq, [HE, EOS])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, None)
    processor, seq = make(SamplingParams(max_tokens=10, ignore_eos=True))
    assert feed(processor, seq, [HE, EOS, LL]) is None
    assert seq.output_token_ids == [HE, EOS, LL]


def test_a_stop_token_id_names_itself_as_the_stop_reason():
    processor, seq = make(SamplingParams(max_tokens=10, stop_token_ids=[OH]))
    stop = feed(processor, seq, [HE, LL, OH])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, OH)


@pytest.mark.parametrize(
    "params, token_ids, reason, kept",
    [
        (dict(stop_token_ids=[OH]), [HE, OH, LL, LD], (FinishReason.STOP, OH), [HE, OH]),
        ({}, [HE, EOS, LL], (FinishReason.STOP, None), [HE, EOS]),
        (dict(max_tokens=3), [HE, LL, WOR, LD], (FinishReason.LENGTH, None), [HE, LL, WOR]),
        (dict(stop=["ll"]), [HE, LL, SPACE, WOR], (FinishReason.STOP, "ll"), [HE, LL]),
    ],
    ids=["stop token id", "EOS", "max_tokens", "stop string"],
)
def test_several_tokens_in_one_step_stop_at_the_first_stop_and_drop_the_rest(
    params, token_ids, reason, kept
):
    """Speculative decoding appends the accepted drafts and the bonus token in one step: a
    stop among them ends the request there, the tokens after it are never appended."""
    processor, seq = make(SamplingParams(**({"max_tokens": 10} | params)))
    stop = feed(processor, seq, token_ids)
    assert (stop.reason, stop.stop_reason) == reason
    assert seq.output_token_ids == kept


def test_a_step_that_does_not_stop_appends_all_its_tokens():
    processor, seq = make(SamplingParams(max_tokens=10))
    assert feed(processor, seq, [HE, LL, OH]) is None
    assert seq.output_token_ids == [HE, LL, OH] and not seq.is_finished


def test_a_stop_string_completed_by_the_last_allowed_token_wins_over_length():
    processor, seq = make(SamplingParams(max_tokens=3, stop=["llo"]))
    feed(processor, seq, [HE, LL])
    stop = feed(processor, seq, [OH])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, "llo")
    assert processor.make_output(seq).outputs[0].text == "he"


@pytest.mark.parametrize(
    "params, last, reason",
    [
        (dict(stop_token_ids=[OH]), OH, (FinishReason.STOP, OH)),
        ({}, EOS, (FinishReason.STOP, None)),
        (dict(stop=["lo"]), OH, (FinishReason.STOP, "lo")),
        ({}, OH, (FinishReason.LENGTH, None)),
    ],
    ids=["stop token id", "EOS", "stop string", "nothing else"],
)
def test_a_stop_at_the_last_allowed_token_is_reported_rather_than_the_length(params, last, reason):
    processor, seq = make(SamplingParams(max_tokens=3, **params))
    stop = feed(processor, seq, [HE, LL, last])
    assert (stop.reason, stop.stop_reason) == reason


def test_a_character_cut_off_at_the_end_is_shown_and_can_complete_a_stop_string():
    """The request ends on the first byte of an emoji: a plain decode shows U+FFFD there,
    and a stop string ending in it fires then (the text held back is searched too)."""
    tokenizer = byte_level_tokenizer()
    first_byte = _split_into_bytes(tokenizer("\U0001f600").input_ids[0])[0]
    assert tokenizer.decode([HE, first_byte]) == "he\ufffd"
    processor, seq = make(SamplingParams(max_tokens=2))
    feed(processor, seq, [HE, first_byte])
    assert processor.make_output(seq).outputs[0].text == "he\ufffd"
    processor, seq = make(SamplingParams(max_tokens=2, stop=["e\ufffd"]))
    stop = feed(processor, seq, [HE, first_byte])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, "e\ufffd")
    assert processor.make_output(seq).outputs[0].text == "h"
    # Not before min_tokens: the text of token 2 of min_tokens 2 is never searched.
    processor, seq = make(SamplingParams(max_tokens=2, min_tokens=2, stop=["e\ufffd"]))
    stop = feed(processor, seq, [HE, first_byte])
    assert (stop.reason, stop.stop_reason) == (FinishReason.LENGTH, None)
    assert processor.make_output(seq).outputs[0].text == "he\ufffd"


def test_each_token_is_stamped_with_the_time_of_its_step():
    processor, seq = make(SamplingParams(max_tokens=10))
    processor.append_tokens(seq, [HE, LL], now=1.5)
    processor.append_tokens(seq, [OH], now=2.5)
    assert seq.metrics.first_token_time == 1.5
    assert seq.metrics.token_times == [1.5, 1.5, 2.5]


# --- what is reported -----------------------------------------------------------------------


def test_a_cumulative_output_carries_the_whole_request_each_step():
    processor, seq = make(SamplingParams(max_tokens=2))
    seq.num_cached_tokens = 1
    feed(processor, seq, [HE])
    first = processor.make_output(seq)
    assert (first.request_id, first.prompt, first.prompt_token_ids) == ("r", "the prompt", [5, 6])
    assert (first.finished, first.num_cached_tokens, first.metrics) == (False, 1, seq.metrics)
    [completion] = first.outputs
    assert (completion.index, completion.text, completion.token_ids) == (0, "he", [HE])
    assert (completion.finish_reason, completion.stop_reason) == (None, None)
    feed(processor, seq, [LL])
    last = processor.make_output(seq)
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert (last.outputs[0].text, last.outputs[0].token_ids) == ("hell", [HE, LL])


def test_a_cumulative_output_is_reported_even_after_a_step_without_a_token():
    processor, seq = make(SamplingParams(max_tokens=2))
    output = processor.make_output(seq)  # after a prefill chunk
    assert output is not None and not output.finished
    assert (output.outputs[0].text, output.outputs[0].token_ids) == ("", [])


def test_final_only_reports_once_at_the_end():
    processor, seq = make(SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY))
    feed(processor, seq, [HE])
    assert processor.make_output(seq) is None
    feed(processor, seq, [LL])
    final = processor.make_output(seq)
    assert final.finished and final.outputs[0].text == "hell"


def test_a_delta_output_reports_only_new_tokens_and_nothing_after_a_step_without_one():
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    processor, seq = make(params)
    assert processor.make_output(seq) is None  # a prefill chunk: no token yet
    feed(processor, seq, [HE, LL])
    delta = processor.make_output(seq).outputs[0]
    assert (delta.text, delta.token_ids) == ("hell", [HE, LL])
    assert processor.make_output(seq) is None
    feed(processor, seq, [OH])
    delta = processor.make_output(seq).outputs[0]
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("o", [OH], "length")


def test_a_finished_or_aborted_request_leaves_no_state_behind():
    processor, seq = make(SamplingParams(max_tokens=1))
    feed(processor, seq, [HE])
    processor.make_output(seq)
    assert processor.detokenizers == {}
    processor, seq = make(SamplingParams(max_tokens=5))
    processor.abort_request("r")
    processor.abort_request("never seen")  # a no-op
    assert processor.detokenizers == {}


@pytest.mark.parametrize("skip, text", [(True, "hell"), (False, "he<eos>ll")])
def test_special_tokens_are_left_out_of_the_text_unless_asked_for(skip, text):
    params = SamplingParams(max_tokens=3, ignore_eos=True, skip_special_tokens=skip)
    processor, seq = make(params)
    feed(processor, seq, [HE, EOS, LL])
    assert processor.make_output(seq).outputs[0].text == text


def test_without_a_tokenizer_tokens_still_stop_and_the_text_stays_empty():
    params = SamplingParams(max_tokens=10, stop_token_ids=[OH])
    processor, seq = make(params, tokenizer=False)
    stop = feed(processor, seq, [HE, LL, OH, LD])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, OH)
    output = processor.make_output(seq).outputs[0]
    assert (output.text, output.token_ids) == ("", [HE, LL, OH])


# --- stop strings: which one, and what streaming holds back ---------------------------------


@pytest.mark.parametrize(
    "stop, include, texts",
    [
        (["xyz"], False, ["", "he", "hel", "hello"]),  # the last 2 characters wait
        (["xyz", "abcd"], False, ["", "h", "he", "hello"]),  # the longest stop decides
        (["xyz"], True, ["he", "hell", "hello", "hello"]),  # included: nothing to hide
        ([], False, ["he", "hell", "hello", "hello"]),
    ],
)
def test_streaming_holds_back_what_could_be_the_start_of_a_stop_string(stop, include, texts):
    """A stop string of n characters: the last n - 1 characters shown could be its start,
    so they are shown only once more text (or the end) proves they are not."""
    params = SamplingParams(max_tokens=4, stop=stop, include_stop_str_in_output=include)
    processor, seq = make(params)
    shown = []
    for token in (HE, LL, OH):
        feed(processor, seq, [token])
        shown.append(processor.make_output(seq).outputs[0].text)
    feed(processor, seq, [SPACE])
    shown.append(processor.make_output(seq).outputs[0].text.rstrip())
    assert shown == texts


@pytest.mark.parametrize("stop, expected", [(["ell", "el"], "ell"), (["el", "ell"], "el")])
def test_of_two_stop_strings_cutting_the_text_at_the_same_place_the_first_listed_wins(
    stop, expected
):
    """Both complete with the token "ll" and both start at "e"."""
    processor, seq = make(SamplingParams(max_tokens=10, stop=stop))
    stop_decision = feed(processor, seq, [HE, LL])
    assert stop_decision.stop_reason == expected
    assert processor.make_output(seq).outputs[0].text == "h"


@pytest.mark.parametrize("include, text", [(False, "h"), (True, "hel")])
def test_the_stop_string_that_cuts_the_text_shortest_wins_over_one_listed_earlier(include, text):
    """The token "ll" completes both "ll" and "el": "el" ends (and starts) first."""
    params = SamplingParams(max_tokens=10, stop=["ll", "el"], include_stop_str_in_output=include)
    processor, seq = make(params)
    assert feed(processor, seq, [HE, LL]).stop_reason == "el"
    assert processor.make_output(seq).outputs[0].text == text


def test_a_stop_token_is_the_stop_reason_even_when_its_text_is_a_stop_string():
    params = SamplingParams(
        max_tokens=10, stop_token_ids=[OH], stop=["o"], include_stop_str_in_output=True
    )
    processor, seq = make(params)
    stop = feed(processor, seq, [HE, LL, OH])
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, OH)
    assert processor.make_output(seq).outputs[0].text == "hello"


def test_a_stop_string_twice_in_one_tokens_text_cuts_at_the_first():
    processor, seq = make(SamplingParams(max_tokens=10, stop=["l"]))
    assert feed(processor, seq, [HE, LL]).stop_reason == "l"
    assert processor.make_output(seq).outputs[0].text == "he"


def sentencepiece_style_tokenizer():
    """Words with a leading "▁" (a space), decoded like SentencePiece: the space before the
    first word of a decode is dropped. ``<s>`` is special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "\u2581hello": 1, "\u2581world": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<s>", unk_token="<unk>")


def test_a_special_token_left_out_of_the_text_does_not_glue_the_words_around_it():
    """``<s>`` adds no text; the decoding window must still start at "hello", or "world"
    would be decoded as the first word of a window and lose its space."""
    tokenizer = sentencepiece_style_tokenizer()
    assert tokenizer.decode([0, 2], skip_special_tokens=True) == "world"  # the trap
    processor = OutputProcessor(tokenizer, frozenset({0}), max_model_len=100)
    seq = Sequence("r", [1], SamplingParams(max_tokens=3, ignore_eos=True))
    processor.add_request(seq)
    processor.append_tokens(seq, [1, 0, 2], now=0.0)  # hello <s> world
    assert processor.make_output(seq).outputs[0].text == "hello world"


# --- detokenize=False: token ids only ------------------------------------------------------


class UntouchableTokenizer:
    """Fails the test on any use."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer's {name} was used")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_detokenize_false_makes_no_text_and_never_decodes(kind):
    """The tokens, the stops and the output come as with text; the text stays empty, and
    the tokenizer is never called."""
    params = SamplingParams(max_tokens=9, stop_token_ids=[LD], detokenize=False, output_kind=kind)
    processor = OutputProcessor(UntouchableTokenizer(), frozenset({EOS}), max_model_len=100)
    seq = Sequence("r", [5, 6], params)
    processor.add_request(seq)
    reported = []
    sampled = [HE, LL, OH, SPACE, WOR, LD]
    for token in sampled:
        stop = feed(processor, seq, [token])
        output = processor.make_output(seq)
        if output is not None:
            reported.append(output)
        if stop is not None:
            break
    assert (stop.reason, stop.stop_reason) == (FinishReason.STOP, LD)
    assert seq.output_token_ids == sampled
    assert all(o.outputs[0].text == "" for o in reported)
    assert [o.finished for o in reported][-1]
    reported_ids = [o.outputs[0].token_ids for o in reported]
    if kind is RequestOutputKind.CUMULATIVE:  # everything so far, every step
        assert reported_ids == [sampled[:i] for i in range(1, 7)]
    elif kind is RequestOutputKind.DELTA:  # the new token, every step
        assert reported_ids == [[t] for t in sampled]
    else:
        assert reported_ids == [sampled]


def test_detokenize_false_and_true_give_the_same_tokens_and_stops():
    for tokens in ([HE, LL, EOS, OH], [HE, LL, OH, SPACE, WOR, LD, HE]):
        stops = []
        for detokenize in (True, False):
            processor, seq = make(SamplingParams(max_tokens=6, detokenize=detokenize))
            stop = feed(processor, seq, tokens)
            stops.append((stop.reason, stop.stop_reason, seq.output_token_ids))
        assert stops[0] == stops[1]


@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_detokenize_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="detokenize must be True or False"):
        SamplingParams(detokenize=bad)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match=r"stop strings \['world'\].*need detokenize=True"):
        SamplingParams(stop="world", detokenize=False)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_detokenize_false_keeps_the_logprobs_rows_without_their_text(kind):
    """Logprobs and prompt logprobs are reported as with text, each token without its
    text, and the tokenizer is never called for them."""
    params = SamplingParams(
        max_tokens=2, logprobs=0, prompt_logprobs=0, detokenize=False, output_kind=kind
    )
    processor = OutputProcessor(UntouchableTokenizer(), frozenset({EOS}), max_model_len=100)
    seq = Sequence("r", [5, 6], params)
    processor.add_request(seq)
    output_rows, prompt_rows = [], []
    for i, token in enumerate([HE, LL]):
        out = ModelRunnerOutput({"r": [token]}, logprobs={"r": [{token: Logprob(-1.0 - i)}]})
        if i == 0:
            out.prompt_logprobs["r"] = (1, [{6: Logprob(-3.0)}])
        processor.record_logprobs(seq, out)
        feed(processor, seq, [token])
        output = processor.make_output(seq)
        if output is not None:
            output_rows = (output_rows if kind is RequestOutputKind.DELTA else []) + list(
                output.outputs[0].logprobs
            )
            prompt_rows = output.prompt_logprobs or prompt_rows
    assert seq.is_finished
    assert [[(t, lp.logprob) for t, lp in r.items()] for r in output_rows] == [
        [(HE, -1.0)], [(LL, -2.0)]
    ]  # fmt: skip
    assert prompt_rows[0] is None and [list(r) for r in prompt_rows[1:]] == [[6]]
    rows = output_rows + prompt_rows[1:]
    assert all(lp.decoded_token is None for row in rows for lp in row.values())
