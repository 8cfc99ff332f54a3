"""How one request wants its tokens chosen and when it should stop (mirrors vLLM's)."""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, fields

from minivllm.utils import as_int

# Below this temperature a request is greedy (vLLM's ``_SAMPLING_EPS``): dividing logits
# by a tinier one overflows float32 to inf, and softmax then returns NaN.
SAMPLING_EPS = 1e-5
# What torch.Generator.manual_seed accepts: any 64-bit value, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)
# Stop strings are matched on the engine thread after every token: bound their number and
# length so one request cannot make every step slow (or hold back a whole page of text).
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 256
# vLLM's (and OpenAI's) ranges.
PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty, presence_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# A seen token's positive logit is divided by repetition_penalty: a penalty near 0 makes it
# +inf (from ~1e-38 in float32), every such token ties at +inf and the softmax gives NaN.
# From 0.01 a logit grows at most 100x and stays finite, so the top token survives.
MIN_REPETITION_PENALTY = 0.01
MAX_LENGTH_PENALTY_DECADES = 30  # see BeamSearchParams
# vLLM's default ``max_logprobs`` (OpenAI's chat ``top_logprobs`` allows as many).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` reports for a request that made progress."""

    CUMULATIVE = 0  # everything generated so far (vLLM's default)
    DELTA = 1  # only what is new since the last report: for streaming
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class StructuredOutputsParams:
    """A constraint on the text a request may produce (vLLM's ``StructuredOutputsParams``).

    Exactly one of: ``json``, a JSON schema (a dict, or its text); ``regex``, a regular
    expression the whole output matches; ``choice``, the output is one of these strings;
    ``grammar``, a context-free grammar (Lark or GBNF, as llguidance reads them);
    ``json_object=True``, any JSON object. The engine turns it into a token mask per step
    (structured_output/): every output that finishes with ``stop`` is in the language.
    Types and "exactly one" are checked here; whether the schema, regex or grammar compiles
    is checked when the engine adds the request (ValueError naming the field)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        kind = given[0]
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(self.json, dict):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema object, got {self.json!r}"
                )
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of strings, "
                f"got {self.choice!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if kind == "json_object" and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true or left out")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which of the fields is set: "json", "regex", "choice", "grammar", "json_object"."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: the cache key (a schema as canonical JSON,
        so the same schema written twice compiles once)."""
        spec = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            spec = json.dumps(spec, sort_keys=True)
        return self.kind, str(spec)


@dataclass
class SamplingParams:
    """Sampling and stopping settings for one request.

    ``n``: how many completions of the prompt to return (parallel sampling; child ``i``
    samples with ``seed + i`` when a seed is given). ``temperature=0`` (anything below
    ``SAMPLING_EPS``) means greedy. ``top_k=0`` (or -1),
    ``top_p=1`` and ``min_p=0`` switch those filters off. ``seed`` makes this request's
    random choices reproducible whatever else shares its batch. ``min_tokens``: no stop
    (EOS, stop ids, stop strings) before that many tokens; EOS and stop ids are not even
    sampled.

    Penalties and biases change the logits before anything else (vLLM's definitions):
    ``logit_bias`` adds to chosen tokens' logits; ``repetition_penalty`` divides the
    positive logits (multiplies the negative ones) of every token already in the prompt or
    the output, as transformers' ``RepetitionPenaltyLogitsProcessor``; OpenAI's
    ``frequency_penalty`` subtracts ``penalty * count`` and ``presence_penalty`` subtracts
    ``penalty`` once, for tokens in the output so far. ``allowed_token_ids``: only these
    may be sampled.

    ``detokenize=False``: no text is made (``text`` stays ""; token ids and logprobs come
    as usual, logprobs without ``decoded_token``), for a client that reads token ids only:
    the request then costs no detokenization per token. Stop strings need the text, so
    they need ``detokenize=True``.

    ``structured_outputs``: the output must be JSON of a schema, match a regex, be one of
    some choices or follow a grammar (`StructuredOutputsParams`; the mask is applied
    before anything else, so only allowed tokens are ever sampled).

    ``logprobs=k``: each output token comes with its log-probability and the ``k`` most
    likely tokens' (``0``: the sampled token's only); ``prompt_logprobs=k``: the same for
    every prompt token but the first. Both are taken from the model's raw logits, before
    any bias, penalty or temperature (vLLM's default ``logprobs_mode="raw_logprobs"``).
    Invalid values raise ValueError at construction (token ids are checked
    against the vocabulary when the request is added); integer fields accept numpy and
    torch integers too.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {self.structured_outputs!r}"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list | tuple | None):
                raise ValueError(f"{name} must be a list, got {getattr(self, name)!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = [as_int("stop_token_ids", t) for t in self.stop_token_ids or []]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict, got {self.logit_bias!r}")
            self.logit_bias = {as_int("logit_bias", t): b for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple):
                raise ValueError(
                    f"allowed_token_ids must be a list, got {self.allowed_token_ids!r}"
                )
            self.allowed_token_ids = [
                as_int("allowed_token_ids", t) for t in self.allowed_token_ids
            ]
        self.n, self.top_k, self.min_tokens = (
            as_int(name, getattr(self, name)) for name in ("n", "top_k", "min_tokens")
        )
        if self.max_tokens is not None:
            self.max_tokens = as_int("max_tokens", self.max_tokens)
        if self.seed is not None:
            self.seed = as_int("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int(name, getattr(self, name)))
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        for name in (
            "temperature", "top_p", "min_p",
            "repetition_penalty", "frequency_penalty", "presence_penalty",
        ):  # fmt: skip
            _check_real(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:  # also catches NaN
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be 0 or -1 (disabled) or a positive int, got {self.top_k}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self._validate_penalties()
        self._validate_stop_strings()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.seed is not None and self.seed + self.n - 1 > SEED_RANGE[1]:
            # child i of an n > 1 request samples with seed + i (parallel_sampling.py)
            raise ValueError(f"seed + n - 1 must fit in 64 bits, got seed={self.seed}, n={self.n}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be True or False, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings {self.stop!r} are matched in the text: they need detokenize=True"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def _validate_penalties(self) -> None:
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be finite and >= {MIN_REPETITION_PENALTY} (1 is "
                f"none), got {self.repetition_penalty}"
            )
        low, high = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {getattr(self, name)}")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in (self.logit_bias or {}).items():
            _check_real("logit_bias", bias)
            if token < 0 or not low <= bias <= high:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to biases in [{low}, {high}], "
                    f"got {token}: {bias}"
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            raise ValueError(
                f"allowed_token_ids must be a non-empty list of token ids, "
                f"got {self.allowed_token_ids!r}"
            )

    def _validate_stop_strings(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings, more than the {MAX_STOP_STRINGS} allowed"
            )
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(stop)}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens so far (so the sampler needs them)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids in ``logit_bias`` and ``allowed_token_ids`` must be in the vocabulary
        (the vocabulary size is the engine's, so this is checked when a request is added)."""
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
                )


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's ``BeamSearchParams``; `LLM.beam_search`).

    ``beam_width`` beams are kept; each step every beam proposes its most likely next
    tokens and the best continuations over all beams survive (beam_search.py). A beam
    ends at EOS (unless ``ignore_eos``) or after ``max_tokens`` tokens; a finished beam's
    score is ``cum_logprob / num_output_tokens ** length_penalty`` (transformers'), so a
    ``length_penalty`` above 1 favours longer outputs, below 1 shorter ones.
    ``temperature`` is accepted for vLLM's signature: beams are chosen from the model's
    raw log-probabilities (as vLLM v1 returns them), which temperature does not change.
    Each beam asks for ``2 * beam_width`` logprobs (more with several EOS ids), at most
    ``MAX_LOGPROBS`` as vLLM's default ``max_logprobs``: so ``beam_width <= 10``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; beams stop at EOS only

    def __post_init__(self) -> None:
        self.beam_width = as_int("beam_width", self.beam_width)
        self.max_tokens = as_int("max_tokens", self.max_tokens)
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"beam_width must be in [1, {MAX_LOGPROBS // 2}] (each beam asks for "
                f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got {self.beam_width}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            _check_real(name, getattr(self, name))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        # A score divides cum_logprob by num_tokens ** length_penalty in float32: keep that
        # factor within 1e+-30 at any length up to max_tokens, which leaves the sum of the
        # logprobs 8 decades before the score overflows (or every score flushes to -0.0).
        bound = (
            MAX_LENGTH_PENALTY_DECADES / math.log10(self.max_tokens)
            if self.max_tokens > 1
            else math.inf
        )
        if not abs(self.length_penalty) <= bound:
            raise ValueError(
                f"length_penalty must be in [-{bound:.2f}, {bound:.2f}] for max_tokens="
                f"{self.max_tokens} (max_tokens ** length_penalty must stay within "
                f"1e+-{MAX_LENGTH_PENALTY_DECADES} in float32), got {self.length_penalty}"
            )
