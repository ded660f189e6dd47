"""The input checks every door shares: one function per rule, one message shape per rule.

Each raises `UsageError` (exit 2 at the command line) naming `what` is wrong: a flag such as
`--precision` (the Python API's arguments, `Runtime(precision=...)`, share those names).

    unknown value:  "--device: unknown value 'tpu'; choose from auto, cpu, cuda"
    a number:       "--epochs must be positive, got 0"
    a shape:        "--synthetic-shape must be positive integers like 3,32,32, got '3,x'"
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .errors import UsageError


def flag(name: str) -> str:
    """The command-line flag of a setting: 'batch_size' -> '--batch-size'."""
    return "--" + name.replace("_", "-")


def choice(what: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` if it is one of `choices`."""
    options = tuple(choices)
    if value not in options:
        raise UsageError(choice_message(what, value, options))
    return value


def choice_message(what: str, value: Any, choices: Iterable[Any]) -> str:
    return f"{what}: unknown value {value!r}; choose from {', '.join(map(str, choices))}"


def positive(what: str, value: float) -> float:
    """`value` if it is a finite number above zero (`not >` also catches NaN)."""
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"{what} must be positive, got {value}")
    return value


def at_least(what: str, value: float, low: float) -> float:
    if not value >= low:
        raise UsageError(f"{what} must be >= {low:g}, got {value}")
    return value


def in_range(what: str, value: float, low: float, high: float) -> float:
    """`value` if low <= value < high."""
    if not low <= value < high:
        raise UsageError(f"{what} must be in [{low:g}, {high:g}), got {value}")
    return value


def int_list(what: str, text: str, example: str) -> tuple[int, ...]:
    """Positive integers separated by commas, such as a shape '3,32,32'."""
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise UsageError(f"{what} must be positive integers like {example}, got {text!r}")
    return values


def shape(what: str, text: str) -> tuple[int, ...]:
    """One sample's shape from 'C,H,W' (or any number of dimensions)."""
    return int_list(what, text, "3,32,32")
