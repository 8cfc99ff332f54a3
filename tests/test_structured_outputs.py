"""Structured outputs in the batch: every output that finishes is in its constraint's
language, whatever the engine does around it (async, chunked prefill, preemption, prefix
caching, speculative decoding); greedy output equals transformers' with the same mask;
requests without a constraint are untouched.

The model is a tiny random llama over a byte-level tokenizer (structured_helpers.py), so
that it can spell any JSON; its outputs are nonsense inside the grammar's bounds, which
is exactly what a mask has to survive."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minivllm import StructuredOutputsParams as SO  # noqa: E402
from minivllm.sampler import apply_grammar_bitmask  # noqa: E402
from minivllm.structured_output.backend import allowed_tokens, bitmask_words  # noqa: E402
from minivllm.structured_output.guidance import GuidanceBackend  # noqa: E402
from tests.helpers import hf_greedy  # noqa: E402
from tests.structured_helpers import make_byte_checkpoint, make_byte_tokenizer  # noqa: E402

BASE = dict(
    num_kv_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
    attention_backend="torch", async_scheduling=False,
)  # fmt: skip
CONFIGS = {
    "sync": {},
    "async": dict(async_scheduling=True),
    "chunked": dict(max_num_batched_tokens=8),
    "preempt": dict(num_kv_blocks=40),
    "prefix": dict(enable_prefix_caching=True),
    "spec": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
}  # fmt: skip
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return str(make_byte_checkpoint(tmp_path_factory.mktemp("bytes")))


_LLMS: dict[tuple[str, str], LLM] = {}


def llm_for(path: str, config: str) -> LLM:
    key = (path, config)
    if key not in _LLMS:
        _LLMS[key] = LLM(path, **{**BASE, **CONFIGS[config]})
    return _LLMS[key]


# --- constraints, drawn -------------------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 200),
    ),  # fmt: skip
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abc xy", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _object(children):
    props = st.dictionaries(
        st.from_regex(r"[a-z]{1,3}", fullmatch=True), children, min_size=1, max_size=3
    )
    return props.map(
        lambda p: {
            "type": "object",
            "properties": p,
            "required": sorted(p),
            "additionalProperties": False,
        }  # fmt: skip
    )


def _array(children):
    return st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children,
                     st.integers(0, 2))  # fmt: skip


# Bounded schemas: every instance is short, so a complete output fits in MAX_TOKENS.
schemas = st.recursive(_leaf, lambda c: st.one_of(_object(c), _array(c)), max_leaves=4)
_atoms = st.sampled_from(["[a-z]", "[0-9]", "[A-F]", "x", "-", r"\.", "(ab|cd)", " "])
regexes = st.lists(
    st.builds(lambda a, m, k: f"{a}{{{m},{m + k}}}", _atoms, st.integers(0, 2), st.integers(0, 3)),
    min_size=1, max_size=4,
).map("".join)  # fmt: skip
choices = st.lists(st.text("abcxyz {}", min_size=1, max_size=6), min_size=1, max_size=4,
                   unique=True)  # fmt: skip


def check(constraint: SO, text: str) -> None:
    """The text is in the constraint's language."""
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), (constraint.regex, text)
    else:
        assert text in constraint.choice


def batch(schema, regex, choice, temperature):
    """A mixed batch: three constrained requests, two free ones (one greedy)."""
    constraints = [SO(json=schema), SO(regex=regex), SO(choice=choice)]
    prompts = ['{"ab": [1, 2], "c": "x"} {"ab":', "hello", "abc abc", "free", "free too"]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=temperature, seed=i, structured_outputs=c
        )  # fmt: skip
        for i, c in enumerate(constraints)
    ] + [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, seed=7)]
    return constraints, prompts, params


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=4)
@given(schema=schemas, regex=regexes, choice=choices, temperature=st.sampled_from([0.0, 1.0]))
def test_every_output_is_in_its_language(byte_model, config, schema, regex, choice, temperature):
    """Each constrained output finishes with "stop" and validates; and the whole batch's
    tokens are the same as the plain synchronous engine's, constrained or not: async,
    chunked prefill, preemption, prefix caching and drafts change when things are
    computed, never what is sampled (seeded requests draw the same noise; drafts are
    verified by rejection sampling, which draws differently: there, greedy requests)."""
    constraints, prompts, params = batch(schema, regex, choice, temperature)
    outputs = llm_for(byte_model, config).generate(prompts, params, use_tqdm=False)
    for constraint, output in zip(constraints, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (constraint, completion.text)
        check(constraint, completion.text)
    if config != "sync":
        reference = llm_for(byte_model, "sync").generate(prompts, params, use_tqdm=False)
        same = [i for i, p in enumerate(params) if config != "spec" or p.greedy]
        assert [outputs[i].outputs[0].token_ids for i in same] == [
            reference[i].outputs[0].token_ids for i in same
        ]


def test_configs_did_what_they_say(byte_model):
    """The configurations above really preempt and really draft (so the property test
    exercised the replay and the rollback), with constrained requests in the batch."""
    digits = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "properties": {"ab": {"type": "array", "items": digits,
              "maxItems": 3}}, "required": ["ab"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs=SO(json=schema)
    )
    prompts = ['{"ab": [1, 2, 3]} {"ab": [1, 2, 3]} {"ab": [', "x" * 20, "y" * 30, "z" * 40]
    for config in ("preempt", "spec"):
        llm = llm_for(byte_model, config)
        outputs = llm.generate(prompts, [params] * 4, use_tqdm=False)
        for output in outputs:
            assert output.outputs[0].finish_reason == "stop"
            check(SO(json=schema), output.outputs[0].text)
        engine = llm.llm_engine
        if config == "preempt":
            assert engine.scheduler.num_preemptions > 0
        else:
            assert engine.spec_decoding_stats.num_draft_tokens > 0


# --- the mask itself ----------------------------------------------------------------------


@given(
    num_rows=st.integers(1, 6),
    vocab_size=st.integers(1, 100),
    data=st.data(),
)
def test_bitmask_masks_exactly_the_listed_rows(num_rows, vocab_size, data):
    logits = torch.randn(num_rows, vocab_size)
    rows = data.draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=num_rows))
    words = bitmask_words(vocab_size)
    bitmask = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=words,
                                    max_size=words), min_size=len(rows), max_size=len(rows))),
        dtype=torch.int32,
    ).reshape(len(rows), words)  # fmt: skip
    masked = apply_grammar_bitmask(logits, rows, bitmask)
    for row in range(num_rows):
        if row not in rows:
            assert torch.equal(masked[row], logits[row])
            continue
        word_row = bitmask[rows.index(row)].tolist()
        for token in range(vocab_size):
            allowed = (word_row[token // 32] >> (token % 32)) & 1
            expected = logits[row, token].item() if allowed else float("-inf")
            assert masked[row, token].item() == expected
        assert torch.equal(allowed_tokens(bitmask[rows.index(row)], vocab_size),
                           masked[row] > float("-inf"))  # fmt: skip


def test_draft_rows_follow_the_drafts_and_the_matcher_ends_where_it_began():
    """Row j + 1 of a request with drafts is the mask after drafts 0..j; after a draft
    the grammar refuses, rows keep the "anything" mask (the sampler rejects that draft at
    its own row); the matcher is rolled back."""
    tokenizer = make_byte_tokenizer()
    vocab_size = 272
    backend = GuidanceBackend(tokenizer, vocab_size)
    compiled = backend.compile(SO(regex=r"ab[0-9]{2}"))
    from minivllm.structured_output.manager import StructuredOutputManager

    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "ab12z"}
    grammar = compiled.new_matcher()
    bitmask = torch.full((5, bitmask_words(vocab_size)), -1, dtype=torch.int32)  # as the step
    drafts = [ids["a"], ids["b"], ids["z"], ids["1"]]
    StructuredOutputManager._fill_rows(grammar, drafts, bitmask, 0)
    for j in range(3):  # rows 0, 1, 2: the masks after drafts[:j]
        fresh = compiled.new_matcher()
        assert fresh.accept_tokens(drafts[:j])
        expected = torch.zeros(1, bitmask.shape[1], dtype=torch.int32)
        fresh.fill_bitmask(expected, 0)
        assert torch.equal(bitmask[j], expected[0])
    assert torch.equal(bitmask[3:], torch.full_like(bitmask[3:], -1))  # after "z": unused
    allowed = allowed_tokens(bitmask[0], vocab_size).nonzero().flatten().tolist()
    assert allowed == [ids["a"]]  # nothing consumed: the grammar is at its start again
    assert grammar.validate_tokens(drafts) == 2


# --- the engine around it -----------------------------------------------------------------


def test_free_requests_take_the_same_path(byte_model):
    """A free request's tokens are the same whether constrained requests share its batch
    or not; and a step without constrained requests carries no mask."""
    llm = llm_for(byte_model, "sync")
    free = [SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20, seed=3)]
    alone = llm.generate(["one", "two"], free, use_tqdm=False)
    constrained = SamplingParams(max_tokens=20, structured_outputs=SO(regex="[0-9]{5}"))
    mixed = llm.generate(["one", "two", "three"], free + [constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    engine = llm.llm_engine
    engine.add_request("plain", "four", SamplingParams(max_tokens=2))
    engine.step()
    assert engine.last_step.grammar_bitmask is None and not engine.structured_output.requests


def test_n_children_have_their_own_matchers(byte_model):
    outputs = llm_for(byte_model, "sync").generate(
        ["pick"],
        SamplingParams(
            n=4,
            max_tokens=40,
            temperature=1.0,
            seed=1,
            structured_outputs=SO(regex="[a-z]{1,3}-[0-9]{1,3}"),
        ),  # fmt: skip
        use_tqdm=False,
    )
    texts = [c.text for c in outputs[0].outputs]
    assert len(texts) == 4 and len(set(texts)) > 1, texts
    for text in texts:
        assert re.fullmatch("[a-z]{1,3}-[0-9]{1,3}", text)


def test_a_complete_output_stops_even_with_ignore_eos(byte_model):
    output = llm_for(byte_model, "sync").generate(
        ["x"], SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=SO(choice=["ok"])),
        use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert output.finish_reason == "stop" and output.text == "ok"


def test_cache_hits_and_json_object(byte_model):
    llm = LLM(byte_model, **BASE)
    stats = llm.llm_engine.structured_output.stats
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs=SO(json_object=True)
    )
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert (stats.num_compiles, stats.num_cache_hits) == (1, 2)
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(output.outputs[0].text), dict)
    # The same schema written with its keys in another order is the same grammar.
    a = SO(json={"type": "object", "properties": {"x": {"type": "null"}}})
    b = SO(json='{"properties": {"x": {"type": "null"}}, "type": "object"}')
    assert a.key == b.key


class _SlowBackend:
    """llguidance, but each compile waits for ``release``."""

    def __init__(self, tokenizer, vocab_size):
        self.inner = GuidanceBackend(tokenizer, vocab_size)
        self.release = threading.Event()

    def compile(self, params):
        assert self.release.wait(30)
        return self.inner.compile(params)


def test_a_compiling_grammar_never_stalls_other_requests(byte_model):
    """vLLM's WAITING_FOR_FSM: while a grammar compiles, its request waits outside the
    scheduler and every other request runs to the end; then it runs too. Aborting one
    that waits works like any abort."""
    engine = LLMEngine(EngineConfig(model=byte_model, **BASE))
    backend = {}
    engine.structured_output.make_backend = lambda t, v: backend.setdefault("b", _SlowBackend(t, v))
    engine.add_request(
        "json", "a", SamplingParams(max_tokens=40, structured_outputs=SO(regex="[0-9]{3}"))
    )
    engine.add_request(
        "gone", "a", SamplingParams(max_tokens=40, structured_outputs=SO(regex="[a-z]{3}"))
    )
    engine.add_request("free", "b", SamplingParams(max_tokens=10, temperature=0))
    finished = {}
    while "free" not in finished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "json" in engine.structured_output.waiting and "json" not in engine.scheduler.requests
    assert engine.abort_request("gone") and engine.get_num_unfinished_requests() == 1
    backend["b"].release.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert re.fullmatch("[0-9]{3}", finished["json"].outputs[0].text)
    assert "gone" not in finished
    engine.close()


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(regex="a(b"), "structured_outputs.regex does not compile"),
        (dict(json={"type": "foo"}), "structured_outputs.json does not compile"),
        (dict(json={"type": "string", "minLength": 3, "maxLength": 1}), "Unsatisfiable"),
        (dict(grammar="start: nowhere"), "structured_outputs.grammar does not compile"),
    ],
)
def test_bad_constraints_are_refused_before_any_work(byte_model, constraint, message):
    engine = llm_for(byte_model, "sync").llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", "x", SamplingParams(structured_outputs=SO(**constraint)))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
        (dict(json=[1]), "structured_outputs.json must be a JSON schema object"),
        (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
        (dict(choice=["a", 1]), "structured_outputs.choice must be a non-empty list"),
        (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
        (dict(json_object="yes"), "structured_outputs.json_object must be true"),
    ],
)
def test_structured_outputs_params_checks_its_fields(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SO(**fields)


def test_grammar_accepts_lark_and_gbnf(byte_model):
    llm = llm_for(byte_model, "sync")
    for grammar in ('start: "yes" | "no"', 'root ::= "yes" | "no"'):
        output = llm.generate(
            ["?"], SamplingParams(max_tokens=10, structured_outputs=SO(grammar=grammar)),
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert output.text in ("yes", "no") and output.finish_reason == "stop"


# --- parity with transformers ---------------------------------------------------------------


def hf_constrained_greedy(model, backend, constraint, prompt_ids, max_new_tokens, eos):
    """transformers' greedy loop with a logits processor applying the same grammar's mask
    (the grammar's own matcher, fed the argmax each step)."""
    matcher = backend.compile(constraint).new_matcher()
    words = bitmask_words(backend.vocab_size)
    generated, ids, past = [], torch.tensor([prompt_ids]), None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            mask = torch.zeros(1, words, dtype=torch.int32)
            matcher.fill_bitmask(mask, 0)
            logits = apply_grammar_bitmask(logits, [0], mask)
            token = int(logits.argmax(-1))
            generated.append(token)
            assert matcher.is_terminated() or matcher.accept_tokens([token])
            if token in eos:
                break
            ids = torch.tensor([[token]])
    return generated


def test_greedy_equals_transformers_with_the_same_mask(byte_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(byte_model, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(byte_model)
    backend = GuidanceBackend(tokenizer, hf.config.vocab_size)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 999}, "s": {"type": "string", "maxLength": 4}},
              "required": ["n", "s"], "additionalProperties": False}  # fmt: skip
    constraints = [SO(json=schema), SO(regex="[a-f]{2,6}"), SO(choice=["red", "green", "blue"])]
    prompts = ["The answer:", "hex", "colour?"]
    llm = llm_for(byte_model, "sync")
    outputs = llm.generate(
        prompts,
        [SamplingParams(max_tokens=60, temperature=0, structured_outputs=c) for c in constraints],
        use_tqdm=False,
    )
    for prompt, constraint, output in zip(prompts, constraints, outputs):
        expected = hf_constrained_greedy(
            hf, backend, constraint, output.prompt_token_ids, 60, {tokenizer.eos_token_id}
        )
        assert output.outputs[0].token_ids == expected, prompt


@pytest.mark.slow
def test_smollm2_constrained_greedy_equals_transformers(smollm2_path):
    """The real model on the parity prompts (test_parity.py), each under a constraint, in
    one batch with chunked prefill and preemption pressure: token for token the same as
    transformers' greedy loop with the same grammar's mask."""
    from transformers import AutoModelForCausalLM

    from tests.test_parity import SMOL_PROMPTS

    llm = LLM(str(smollm2_path), num_kv_blocks=14, block_size=8, max_num_batched_tokens=48)
    tokenizer = llm.get_tokenizer()
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    constraints = [
        SO(choice=["Paris", "Lyon", "Marseille"]),
        SO(json=person),
        SO(regex=r"    return [a-z0-9 +()-]{1,30}"),
        SO(json_object=True),
        SO(regex=r"( [0-9]+,){1,4}"),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=32, structured_outputs=c) for c in constraints
    ]
    # Two free requests in the same batch, long enough to press on the KV pool.
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(SMOL_PROMPTS + SMOL_PROMPTS[:2], params + [free] * 2, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    backend = GuidanceBackend(tokenizer, hf.config.vocab_size)
    eos = set(llm.llm_engine.model_info.eos_token_ids)
    for output in outputs[len(constraints) :]:
        assert output.outputs[0].token_ids == hf_greedy(hf, output.prompt_token_ids, 40)
    for constraint, output in zip(constraints, outputs):
        expected = hf_constrained_greedy(hf, backend, constraint, output.prompt_token_ids, 32, eos)
        assert output.outputs[0].token_ids == expected, (output.prompt, output.outputs[0].text)
        if output.outputs[0].finish_reason == "stop":
            check(constraint, output.outputs[0].text)


def test_benchmark_script_runs_equal_work(byte_model):
    """benchmarks/structured_outputs.py on the tiny model: both batches generate the same
    number of tokens (so its ratio compares equal work) and every part is reported."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import structured_outputs as bench

    result = bench.main(["--model", byte_model, "--num-requests", "4", "--output-len", "6",
                         "--repeats", "1"])  # fmt: skip
    assert result["tokens"] == {"free": 24, "constrained": 24}
    assert result["num_compiles"] + result["num_cache_hits"] == 2
    assert result["mask_fill_ms_per_step"] > 0 and result["mask_apply_ms_per_step"] > 0
    assert result["masked_rows_per_step"] > 0


def test_bitmask_rows_follow_the_runners_sampled_rows():
    """Rows are numbered as the model runner samples: each sampling chunk in order, ``1 +
    num_draft_tokens`` rows each; a chunk that samples nothing has none; a free request's
    rows are not listed."""
    from minivllm.scheduler_output import ScheduledChunk, SchedulerOutput
    from minivllm.structured_output import StructuredOutputManager

    tokenizer = make_byte_tokenizer()
    manager = StructuredOutputManager(tokenizer, 272)
    compiled = GuidanceBackend(tokenizer, 272).compile(SO(regex="[ab]+"))
    manager.requests = {"json": compiled.new_matcher(), "late": compiled.new_matcher()}
    a = tokenizer.convert_tokens_to_ids("a")
    out = SchedulerOutput()
    out.chunks = [
        ScheduledChunk("free", [5], 3, (), sample=True),
        ScheduledChunk("json", [a, a, a], 3, (), sample=True, num_draft_tokens=2),
        ScheduledChunk("mid-prompt", [7, 8, 9], 0, (), sample=False),
        ScheduledChunk("free2", [5, a], 3, (), sample=True, num_draft_tokens=1),
        ScheduledChunk("late", [a], 3, (), sample=True),
    ]
    mask = manager.grammar_bitmask(out)
    assert mask.rows == [1, 2, 3, 6] and mask.bitmask.shape == (4, bitmask_words(272))
    # Each row is the mask of its request's matcher at that row's position: "json" at
    # its start, after one draft "a", after two; "late" at its start.
    expected = torch.zeros(4, bitmask_words(272), dtype=torch.int32)
    for row, prefix in enumerate([[], [a], [a, a], []]):
        fresh = compiled.new_matcher()
        assert fresh.accept_tokens(prefix)
        fresh.fill_bitmask(expected, row)
    assert torch.equal(mask.bitmask, expected)
    assert not torch.equal(expected[0], expected[1])  # "a" alone is already complete
    assert manager.stats.num_masked_rows == 4
    manager.grammar_bitmask(out)  # the matchers were rolled back: the same masks again
    assert manager.stats.num_masked_rows == 8
    out.chunks = out.chunks[:1] + out.chunks[2:4]
    assert manager.grammar_bitmask(out) is None


class _BrokenBackend:
    def __init__(self, tokenizer, vocab_size):
        pass

    def compile(self, params):
        raise ValueError("grammar too large")


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(byte_model):
    engine = LLMEngine(EngineConfig(model=byte_model, **BASE))
    engine.structured_output.make_backend = _BrokenBackend
    engine.add_request("bad", "x", SamplingParams(max_tokens=5, structured_outputs=SO(regex="a")))
    engine.add_request("ok", "y", SamplingParams(max_tokens=3, temperature=0))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "grammar too large" in finished["bad"].error
    assert finished["bad"].outputs[0].token_ids == []
    assert len(finished["ok"].outputs[0].token_ids) == 3
    engine.close()


# --- model-free: the backend and the manager on the byte tokenizer alone ----------------

_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
           "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(
    "constraint, good, bad",
    [
        (SO(json=_OBJECT), '{"a": 12}', '{"a":12}'),  # the separators are json.dumps'
        (SO(json_object=True), '{"x": [1, 2]}', "[1]"),
        (SO(regex="ab+"), "abbb", "ba"),
        (SO(choice=["yes", "no"]), "no", "nope"),
        (SO(grammar='start: "x" ("+" "x")*'), "x+x", "x++"),
        (SO(grammar='root ::= "a" | "b"'), "b", "c"),
    ],
)
def test_each_kind_compiles_to_its_language(constraint, good, bad):
    """A text of the language is accepted to the end (EOS included) and completes the
    output; a text outside it is refused at its first wrong token, and a refused token
    leaves the matcher where it was."""
    tokenizer = make_byte_tokenizer()
    compiled = GuidanceBackend(tokenizer, 272).compile(constraint)
    grammar = compiled.new_matcher()
    ids = tokenizer.encode(good, add_special_tokens=False)
    assert not grammar.is_terminated()
    assert grammar.accept_tokens(ids + [tokenizer.eos_token_id])
    assert grammar.is_terminated()
    grammar = compiled.new_matcher()
    bad_ids = tokenizer.encode(bad, add_special_tokens=False)
    num_valid = grammar.validate_tokens(bad_ids)
    assert num_valid < len(bad_ids)
    assert not grammar.accept_tokens(bad_ids)
    assert grammar.validate_tokens(bad_ids) == num_valid  # nothing was accepted
    grammar.rollback(0)
    assert grammar.accept_tokens(bad_ids[:num_valid])


def test_the_manager_compiles_once_per_constraint_and_hands_out_own_matchers():
    """Two requests with one constraint compile once (a cache hit), a third constraint
    compiles again; each admitted request gets its own matcher, in arrival order; a
    matcher's complete output is reported once it takes EOS; removal forgets it."""
    from minivllm.sequence import Sequence
    from minivllm.structured_output import StructuredOutputManager

    tokenizer = make_byte_tokenizer()
    manager = StructuredOutputManager(tokenizer, 272, GuidanceBackend)

    def seq(request_id, constraint):
        return Sequence(request_id, [1], SamplingParams(structured_outputs=constraint))

    manager.add_request(seq("r1", SO(regex="ab")))
    manager.add_request(seq("r2", SO(regex="ab")))
    manager.add_request(seq("r3", SO(choice=["ab", "c"])))
    assert (manager.stats.num_cache_hits, len(manager.cache)) == (1, 2)
    manager.wait_for_compile(timeout=10)
    for future in manager.cache.values():
        future.result(timeout=10)
    ready, failed = manager.take_ready()
    assert [s.request_id for s in ready] == ["r1", "r2", "r3"] and failed == []
    assert manager.stats.num_compiles == 2 and len(manager.stats.compile_s) == 2
    assert not manager.waiting and manager.requests["r1"] is not manager.requests["r2"]
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    assert manager.accept_tokens("r1", []) is False
    assert manager.accept_tokens("r1", [a]) is False
    assert manager.accept_tokens("r1", [b]) is False  # "ab": nothing but EOS can follow
    assert manager.accept_tokens("r1", [tokenizer.eos_token_id]) is True
    assert manager.accept_tokens("r2", [a]) is False  # r2 is still at its own start + "a"
    assert manager.accept_tokens("r2", [a]) is True  # refused: logged, the request stops
    assert manager.accept_tokens("unknown", [a]) is False
    manager.remove("r1")
    assert "r1" not in manager.requests
    manager.shutdown()
