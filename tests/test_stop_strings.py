"""Stop strings, streaming and min_tokens on vLLM's rules, as properties.

Most tests drive the `OutputProcessor` (the one place the engine, the CLI and the server
decide stops) directly with random token sequences of a byte-level BPE tokenizer, no
model needed: such a tokenizer splits CJK characters and emoji over several tokens, the
case where a naive stop-string search goes wrong. Each result is checked against a slow,
obviously correct oracle that decodes every prefix of the tokens from scratch. A few
engine-level tests then run the tiny random model (tests/helpers.py) end to end.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, RequestOutputKind, SamplingParams
from minivllm.detokenizer import Detokenizer
from minivllm.output_processor import OutputProcessor
from minivllm.sampler import Sampler
from minivllm.sequence import FinishReason, Sequence

INCOMPLETE = "\ufffd"
CORPUS = [
    "hello world, 你好世界! 😀 emoji 🎉 and 日本語のテキスト",
    "stop here. 停止 🛑 the end. Ünïcödé ça va? Ελληνικά",
    "the quick brown fox 狐狸 🦊 jumps over 🐕 the lazy dog",
]


@functools.cache
def byte_level_tokenizer():
    """A GPT-2 style byte-level BPE, trained in memory: its 256 byte tokens split any
    multi-byte character, its merges make whole characters and words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


def decode(token_ids: list[int]) -> str:
    return byte_level_tokenizer().decode(token_ids, skip_special_tokens=True)


def reference(token_ids, stops, min_tokens, include_stop):
    """What a request that samples ``token_ids`` (then ends by length) must return: the
    text, the stop string that fired, and how many tokens it kept. Decodes each prefix
    from scratch. Text is "complete" after token k unless it ends mid-character; a stop
    string counts from token min_tokens + 1 on, and must end in the text that token
    completed."""
    completed = ""
    for k in range(1, len(token_ids) + 1):
        text = decode(token_ids[:k])
        is_last = k == len(token_ids)
        if (text.endswith(INCOMPLETE) and not is_last) or len(text) <= len(completed):
            continue
        num_old_chars, completed = len(completed), text
        if k <= min_tokens:
            continue
        matches = []
        for stop in stops:
            start = text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start != -1:
                matches.append((start + len(stop) if include_stop else start, stop))
        if matches:
            cut, stop = min(matches, key=lambda m: m[0])  # a tie goes to the first listed
            return text[:cut], stop, k
    return decode(token_ids), None, len(token_ids)


def run_output_processor(token_ids, params):
    """Feed ``token_ids`` one step at a time through an `OutputProcessor`; returns the
    outputs it reports and the sequence."""
    processor = OutputProcessor(byte_level_tokenizer(), frozenset(), max_model_len=10_000)
    seq = Sequence("r", [0], params)
    processor.add_request(seq)
    outputs = []
    for step, token in enumerate(token_ids):
        stop = processor.append_tokens(seq, [token], now=float(step))
        if stop is not None:
            seq.finish(stop.reason, float(step), stop.stop_reason)
        output = processor.make_output(seq)
        if output is not None:
            outputs.append(output.outputs[0])
        if seq.is_finished:
            break
    assert seq.is_finished
    return outputs, seq


@st.composite
def outputs_and_stops(draw):
    """Random output tokens, and stop strings: mostly pieces of the tokens' own text (so
    they fire), multi-byte characters included, and sometimes strings from elsewhere."""
    vocab_size = len(byte_level_tokenizer())
    eos = byte_level_tokenizer().eos_token_id
    # Byte tokens (ids below 256) split characters; the merged ones above make them whole.
    token = st.one_of(st.integers(0, 255), st.integers(256, vocab_size - 1)).filter(
        lambda t: t != eos
    )
    token_ids = draw(st.lists(token, min_size=1, max_size=24))
    text = decode(token_ids).replace(INCOMPLETE, "")
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.sampled_from(["😀", "你好", "🦊 j", "o", "。", "x"])))
    return token_ids, stops


@given(outputs_and_stops(), st.booleans(), st.integers(0, 6))
def test_stop_strings_match_the_reference(case, include_stop, min_tokens):
    """Final text, stop reason and token count equal the oracle's, so: the text is the
    decoded tokens up to the stop, a stop string ending in a multi-byte character fires,
    nothing before min_tokens is searched."""
    token_ids, stops = case
    params = SamplingParams(
        max_tokens=len(token_ids),
        min_tokens=min(min_tokens, len(token_ids)),
        stop=stops,
        include_stop_str_in_output=include_stop,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    [final], seq = run_output_processor(token_ids, params)
    text, stop, num_tokens = reference(token_ids, stops, params.min_tokens, include_stop)
    assert (final.text, final.stop_reason, final.token_ids) == (
        text,
        stop,
        token_ids[:num_tokens],
    )
    assert final.finish_reason == ("stop" if stop is not None else "length")
    if params.min_tokens == 0 and stop is not None:
        if include_stop:
            assert final.text.endswith(stop)
            assert not any(s in final.text[:-1] for s in stops)
        else:
            assert not any(s in final.text for s in stops)


@given(outputs_and_stops(), st.booleans())
def test_streamed_deltas_add_up_to_the_final_text(case, include_stop):
    """With DELTA outputs, every prefix of the stream is a prefix of the final text (no
    part of a stop string leaks out and is taken back), the deltas add up to it, and each
    token is streamed exactly once. CUMULATIVE outputs agree at every step."""
    token_ids, stops = case
    common = dict(max_tokens=len(token_ids), stop=stops, include_stop_str_in_output=include_stop)
    deltas, _ = run_output_processor(
        token_ids, SamplingParams(**common, output_kind=RequestOutputKind.DELTA)
    )
    cumulative, _ = run_output_processor(
        token_ids, SamplingParams(**common, output_kind=RequestOutputKind.CUMULATIVE)
    )
    final = cumulative[-1]
    streamed = ""
    for delta, snapshot in zip(deltas, cumulative):
        streamed += delta.text
        assert streamed == snapshot.text
        assert final.text.startswith(streamed)
    assert streamed == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert len(deltas) == len(final.token_ids)  # one output per token, none empty


def test_stop_string_spanning_tokens_is_held_back_while_streaming():
    """The leak the issue names: "😀" over byte tokens, stop "o 😀" over three steps."""
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer("hello 😀 world").input_ids
    token_ids = [t for piece in token_ids for t in _split_into_bytes(piece)]
    params = SamplingParams(max_tokens=50, stop=["o 😀"], output_kind=RequestOutputKind.DELTA)
    deltas, seq = run_output_processor(token_ids, params)
    assert "".join(d.text for d in deltas) == "hell"
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, "o 😀")
    assert decode(seq.output_token_ids) == "hello 😀"  # stopped at the token completing it


def _split_into_bytes(token_id: int) -> list[int]:
    """The byte-level tokens spelling one token (the first 256 ids are single bytes)."""
    tokenizer = byte_level_tokenizer()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    return tokenizer.convert_tokens_to_ids(list(piece))


class PythonOnlyTokenizer:
    """A tokenizer with no Rust core for the detokenizer to call directly (a "slow" one):
    it only decodes, through the wrapped tokenizer's Python `decode`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids, skip_special_tokens=False):
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def detokenize(tokenizer, token_ids, params):
    """Each step's (stop string, text so far) through a `Detokenizer`, up to the first
    stop (the request ends there), then its finish."""
    detokenizer, steps = Detokenizer(tokenizer, params), []
    for token_id in token_ids:
        steps.append(
            (detokenizer.update(token_id, stopped_by_token=False), detokenizer.output_text)
        )
        if steps[-1][0] is not None:
            break
    return steps, detokenizer.finish(), detokenizer.output_text


@given(outputs_and_stops(), st.booleans(), st.lists(st.integers(0, 24), max_size=3))
def test_a_tokenizer_without_a_rust_core_gives_the_same_text(case, include_stop, eos_at):
    """The detokenizer calls a fast tokenizer's Rust decoder directly, and a tokenizer
    without one through its `decode`: the same text and stops, step by step, special
    tokens (EOS here, not a stop token) left out of both."""
    token_ids, stops = list(case[0]), case[1]
    for position in eos_at:
        token_ids.insert(min(position, len(token_ids)), byte_level_tokenizer().eos_token_id)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include_stop)
    fast = detokenize(byte_level_tokenizer(), token_ids, params)
    assert detokenize(PythonOnlyTokenizer(byte_level_tokenizer()), token_ids, params) == fast
    steps, stop, text = fast
    if stop is None:  # no stop string fired: all the text, as a plain decode gives it
        assert len(steps) == len(token_ids) and text == decode(token_ids)


class RustCoreOnly:
    """A fast tokenizer whose Python `decode` must not be called: the detokenizer decodes
    twice per output token, and transformers' wrapper costs three times the Rust decode
    it wraps. (No ``clean_up_tokenization_spaces`` either: absent means off.)"""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, token_ids, skip_special_tokens=False):
        raise AssertionError("the Python wrapper was called")


def test_a_fast_tokenizer_is_decoded_by_its_rust_core_alone():
    token_ids = byte_level_tokenizer()("hello world, 你好世界! 😀").input_ids
    _, _, text = detokenize(RustCoreOnly(byte_level_tokenizer()), token_ids, SamplingParams())
    assert text == "hello world, 你好世界! 😀"


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_with_its_clean_up():
    """transformers' `decode` removes the space before punctuation when the tokenizer
    asks for it (`clean_up_tokenization_spaces`, a WordPiece tokenizer's setting); its
    Rust decoder alone does not. The detokenizer then goes through `decode`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "hello", "world", ",", ".", "ok", "##s"]
    core = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece(cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    token_ids = tokenizer("hello, world. oks", add_special_tokens=False).input_ids
    assert core.decode(token_ids) == "hello , world . oks"  # what the Rust core gives
    _, stop, text = detokenize(tokenizer, token_ids, SamplingParams())
    assert (stop, text) == (None, "hello, world. oks")


@pytest.mark.parametrize(
    "stops, stop, text",
    [
        (["t"], "t", ""),
        (["h", "a stop longer than the text so far"], "h", "t"),
        (["e", "th"], "th", ""),  # the earliest match wins, not the first listed
    ],
)
def test_a_stop_string_in_the_first_token_is_found(stops, stop, text):
    """The output's first token, "the", already holds the stop string: it fires there,
    from its first character on, whether or not a longer stop string could end so early."""
    token_ids = byte_level_tokenizer()("the quick brown fox").input_ids
    assert decode(token_ids[:1]) == "the"
    steps, _, _ = detokenize(byte_level_tokenizer(), token_ids[:1], SamplingParams(stop=stops))
    assert steps == [(stop, text)]


def test_stop_token_text_is_left_out_unless_asked_for():
    """vLLM: a stop token id ends the request, its text is not in the output."""
    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer("the quick brown fox").input_ids
    stop_id = token_ids[2]
    for include, expected in ((False, decode(token_ids[:2])), (True, decode(token_ids[:3]))):
        params = SamplingParams(
            max_tokens=10, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        outputs, seq = run_output_processor(token_ids, params)
        assert outputs[-1].text == expected
        assert (outputs[-1].stop_reason, outputs[-1].token_ids) == (stop_id, token_ids[:3])


def test_min_tokens_ignores_stop_token_ids_and_eos_before_it():
    eos = byte_level_tokenizer().eos_token_id
    token_ids = [eos, 300, eos, 301, 302]
    processor = OutputProcessor(byte_level_tokenizer(), frozenset({eos}), max_model_len=100)
    params = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[300])
    seq = Sequence("r", [0], params)
    processor.add_request(seq)
    stops = [processor.append_tokens(seq, [t], 0.0) for t in token_ids[:3]]
    assert stops[:2] == [None, None]
    assert (stops[2].reason, stops[2].stop_reason) == (FinishReason.STOP, None)  # EOS at 3


# --- the sampler's half of min_tokens ------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_masks_eos_and_stop_ids_until_min_tokens(greedy):
    """EOS (id 2) and a stop id (id 3) are the two most likely tokens; before min_tokens
    neither can be drawn, from min_tokens on the favourite wins again."""
    logits = torch.full((1, 8), -5.0)
    logits[0, 2], logits[0, 3] = 30.0, 29.0
    sampler = Sampler(eos_token_ids=frozenset({2}))
    temperature = 0.0 if greedy else 1.0

    def draw(num_output_tokens, **kwargs):
        params = SamplingParams(temperature=temperature, min_tokens=4, stop_token_ids=[3], **kwargs)
        seq = Sequence("r", [1] + [5] * num_output_tokens, params)
        seq.num_prompt_tokens = 1
        seq.generator = torch.Generator().manual_seed(num_output_tokens)
        return sampler(logits.clone(), [seq])[0]

    assert all(draw(n) not in (2, 3) for n in range(4))
    assert draw(4) == 2
    assert draw(0, ignore_eos=True) == 2  # ignore_eos: EOS is an ordinary token


def test_temperature_below_epsilon_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 50.0]]) * 1e3
    seq = Sequence("r", [1], SamplingParams(temperature=1e-30))
    assert seq.sampling_params.greedy
    assert Sampler()(logits, [seq]) == [3]


# --- end to end, on the tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), num_kv_blocks=128, block_size=4)


PROMPT = {"prompt_token_ids": [1, 17, 42, 99, 5]}


def _stream(llm, params):
    engine = llm.llm_engine
    engine.add_request("s", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0] for o in engine.step()]
    return outputs


@settings(max_examples=10)  # each example runs the model twice
@given(st.data())
def test_engine_streams_what_it_finally_returns(llm, data):
    """Random stop strings over the tiny model's greedy text (words "w0".."w252" joined by
    spaces, so stops span tokens), streamed as DELTA through the real engine."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [full] = llm.generate([PROMPT], greedy, use_tqdm=False)
    text = full.outputs[0].text
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 6))]
    min_tokens = data.draw(st.integers(0, 8))
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        stop=[stop],
        min_tokens=min_tokens,
        include_stop_str_in_output=data.draw(st.booleans()),
    )
    [final] = llm.generate([PROMPT], params, use_tqdm=False)
    final = final.outputs[0]
    params.output_kind = RequestOutputKind.DELTA
    deltas = _stream(llm, params)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert all(d.token_ids for d in deltas)  # no empty outputs
    assert final.token_ids == full.outputs[0].token_ids[: len(final.token_ids)]
    assert len(final.token_ids) >= min_tokens
    if final.stop_reason is not None:
        # The first occurrence after the text of the first min_tokens tokens.
        def decode(token_ids):
            return llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)

        searched_from = len(decode(final.token_ids[:min_tokens]))
        decoded = decode(final.token_ids)
        at = decoded.find(stop, max(0, searched_from - len(stop) + 1))
        assert at != -1 and at + len(stop) > len(decode(final.token_ids[:-1]))
        assert final.text == decoded[: at + len(stop) if params.include_stop_str_in_output else at]


def test_min_tokens_masks_stop_token_ids_in_the_engine(llm):
    """The greedy favourite made a stop id: before min_tokens it is never sampled."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [full] = llm.generate([PROMPT], greedy, use_tqdm=False)
    stop_id = full.outputs[0].token_ids[1]
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, min_tokens=6, stop_token_ids=[stop_id]
    )
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    token_ids = out.outputs[0].token_ids
    assert stop_id not in token_ids[:6]
    assert token_ids[0] == full.outputs[0].token_ids[0]  # unchanged before the masked one
    assert out.outputs[0].finish_reason == "length" or token_ids[-1] == stop_id


def test_no_empty_delta_for_a_chunked_prefill_step(tiny_llama_path):
    """A 20-token prompt under an 8-token budget takes three steps before its first
    token; DELTA reports nothing for the first two."""
    llm = LLM(
        model=str(tiny_llama_path),
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=8,
        async_scheduling=False,
    )  # each step reports itself, not the step before
    params = SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": list(range(3, 23))}, params)
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append([len(o.outputs[0].token_ids) for o in engine.step()])
    assert per_step == [[], [], [1], [1], [1]]
