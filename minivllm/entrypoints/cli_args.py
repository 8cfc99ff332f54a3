"""The command line's side of the settings (vLLM's ``EngineArgs.add_cli_args`` and
``arg_utils``): one ``--flag`` per `EngineConfig` field, and the argparse types every
command uses. A bad flag value is an ``error: argument --flag: ...`` line and exit code 2
from argparse itself, before anything loads or runs.

The engine's settings (``minivllm/config.py``) know nothing of this module: what is
command-line only (types, aliases, choices) lives here, the help text on the field.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
from pathlib import Path

from minivllm.config import DTYPES, SCHEDULING_POLICIES, EngineConfig
from minivllm.quantization import QUANTIZATION_METHODS
from minivllm.sampling_params import SEED_RANGE


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, unless its help already says it; an
    option without help text still gets its default (argparse would print nothing)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and not action.help and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "(default" in help_text or action.default is argparse.SUPPRESS:
            return help_text
        if not action.option_strings:  # a positional argument has no default to show
            return help_text
        return f"{help_text} (default: %(default)s)".strip()


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    value = _number(text, int)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """Any float but nan and +-inf (their own errors come from the value checks later)."""
    value = _number(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:  # NaN included
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def rate(text: str) -> float:
    """A positive rate; ``inf`` (the default) means everything at once."""
    value = _number(text, float)
    if not value > 0:  # NaN included
        raise argparse.ArgumentTypeError(f"must be a positive number or inf, got {text!r}")
    return value


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def non_empty_str(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def comma_list(choices: tuple[str, ...], name: str):
    """A comma-separated, non-empty list of ``choices`` (each one a ``name``)."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if not items or unknown:
            what = f"unknown {name} {unknown[0]!r}" if unknown else f"no {name} in {text!r}"
            raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(choices)}")
        return items

    return parse


_MEMORY_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
_MEMORY_UNITS |= {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def memory_size(text: str) -> int:
    """``"64MiB"`` -> 67108864; a bare number is bytes. For ``--kv-cache-memory``."""
    number = text.rstrip("BbKkMmGgIi")
    unit = text[len(number) :].upper()
    try:
        value = float(number) * _MEMORY_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"bad memory size {text!r}; use bytes or a unit: 512KiB, 64MiB, 1GiB"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"memory size must be positive, got {text!r}")
    return int(value)


def json_object(text: str) -> dict:
    """A JSON object, e.g. ``--speculative-config '{"num_speculative_tokens": 3}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# What the command line adds to a field beyond its name, type and help: a parser for the
# text, other spellings, the allowed values. A field not listed gets the generic flag:
# ``--field-name``, a positive int for an int, on/off for a bool, text otherwise.
ENGINE_FLAG_OPTIONS: dict[str, dict] = {
    "kv_cache_memory_bytes": {"aliases": ("--kv-cache-memory",), "type": memory_size},
    "tensor_parallel_size": {"aliases": ("-tp",)},
    "dtype": {"choices": ("auto", *DTYPES)},
    "seed": {"type": seed},
    "scheduling_policy": {"aliases": ("--policy",), "choices": SCHEDULING_POLICIES},
    "speculative_config": {"type": json_object},
    "quantization": {"choices": QUANTIZATION_METHODS},
}


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per `EngineConfig` field, with the field's default and help."""
    from minivllm.attention import available_backends

    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude:
            continue
        extra = ENGINE_FLAG_OPTIONS.get(f.name, {})
        flags = ["--" + f.name.replace("_", "-"), *extra.get("aliases", ())]
        options = {"default": f.default, "help": f.metadata.get("help")}
        if f.type.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = extra.get("type", positive_int if f.type.startswith("int") else str)
        if f.name == "attention_backend":
            options["choices"] = ("auto", *available_backends())
        elif "choices" in extra:
            options["choices"] = extra["choices"]
        group.add_argument(*flags, dest=f.name, **options)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` the parsed flags describe, with ``overrides`` on top."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if hasattr(args, f.name)
    }
    return EngineConfig(**(values | overrides))
