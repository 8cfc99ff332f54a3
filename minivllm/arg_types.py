"""Argparse types for the command line: a bad flag value is an ``error: argument --flag:
...`` line and exit code 2 from argparse itself, before anything loads or runs."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from minivllm.sampling_params import SEED_RANGE


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


def length_distribution(spec: str):
    """A benchmark length distribution: ``N``, ``uniform:LO:HI`` or ``lognormal:...``."""
    from minivllm.bench.workloads import LengthDistribution

    try:
        return LengthDistribution.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
