"""The input checks every door shares: one function per rule, one message shape per rule.

Each raises `UsageError` (exit 2 at the command line) naming `what` is wrong: a flag such as
`--precision` (the Python API's arguments, `Runtime(precision=...)`, share those names).

    unknown value:  "--device: unknown value 'tpu'; choose from auto, cpu, cuda"
    a number:       "--epochs must be positive, got 0"
    a shape:        "--synthetic-shape must be positive integers like 3,32,32, got '3,x'"
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Iterable
from typing import Any

from ..errors import UsageError

INT64 = (-(2**63), 2**63 - 1)  # what torch and NumPy take as an integer


def flag(name: str) -> str:
    """The command-line flag of a setting: 'batch_size' -> '--batch-size'."""
    return "--" + name.replace("_", "-")


def choice(what: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` if it is one of `choices`."""
    options = tuple(choices)
    if value not in options:
        raise UsageError(choice_message(what, value, options))
    return value


class _Bounded(reprlib.Repr):
    """repr() cut short at every level: a few items of each container, two levels deep, and
    only the type of an object of any other kind (its own repr could be anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxset, self.maxdict = 2, 4, 4, 4, 4
        self.maxstring = self.maxlong = self.maxother = 60

    def repr_instance(self, x: Any, level: int) -> str:
        if isinstance(x, (float, complex, bool)) or x is None:
            return repr(x)
        return f"<{type(x).__name__}>"


_BOUNDED = _Bounded()


def shown(value: Any, limit: int = 80) -> str:
    """`value` as an error message shows it: a repr of bounded length whatever its structure.
    A plain repr of a value that shares its parts (a YAML alias bomb, a crafted pickle) can run
    for minutes and exhaust memory: this one visits a few items of a few levels."""
    return cut(_BOUNDED.repr(value), limit)


def cut(text: str, limit: int = 80) -> str:
    """`text` as it is, or its first `limit` characters ending in '...'."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def choice_message(what: str, value: Any, choices: Iterable[Any]) -> str:
    return f"{what}: unknown value {shown(value)}; choose from {', '.join(map(str, choices))}"


def positive(what: str, value: float) -> float:
    """`value` if it is a finite number above zero (`not >` also catches NaN)."""
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"{what} must be positive, got {value}")
    return value


def at_least(what: str, value: float, low: float) -> float:
    """`value` if it is a finite number >= low (`not >=` also catches NaN)."""
    if not value >= low or not math.isfinite(value):
        raise UsageError(f"{what} must be >= {low:g}, got {value}")
    return value


def integer(what: str, value: int, low: int, high: int) -> int:
    """`value` if low <= value <= high (an int: bounds printed whole, not as 4.29497e+09)."""
    if not low <= value <= high:
        raise UsageError(f"{what} must be an integer from {low} to {high}, got {value}")
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
        raise UsageError(f"{what} must be positive integers like {example}, got {shown(text)}")
    return values


def directory(what: str, path: str) -> str:
    """`path` if it is a directory, or could be made one: no file at it or above it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} {path}: not a directory")
    _writable_parent(what, path)
    return path


def output_file(what: str, path: str) -> str:
    """`path` if a file can be written there later, checked now without writing anything: not a
    directory, a device or a pipe, and the nearest existing folder above it a writable
    directory (the missing ones are made when the file is written). Output goes last, after the
    work: checking it first means a typo costs nothing."""
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        # A device or a pipe, or a link to one (/dev/stdout): the file is written beside it and
        # renamed over it (`atomic_write`), which as root replaced /dev/null itself with a file of
        # JSON. A link to a regular file, or to nothing yet, is replaced as before.
        raise UsageError(f"{what} {path}: not a regular file (a device or a pipe); give a file name")
    folder = _writable_parent(what, path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: cannot write in {folder}")
    return path


def _writable_parent(what: str, path: str) -> str:
    """The nearest existing folder above `path`, which must be a directory."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: {folder} is not a directory")
    return folder


def memory(what: str, nbytes: float, processes: int = 1) -> None:
    """Refuse `what` when `processes` copies of `nbytes` exceed the memory this machine can
    still give out: one line now instead of an allocation traceback in every worker."""
    from .memory import available_mib  # imports torch: not at import time (`ddpkit --help` stays fast)

    available = available_mib()
    need = nbytes * processes / 2**20
    if available is not None and need > available:
        each = f" in each of {processes} processes" if processes > 1 else ""
        raise UsageError(f"{what} needs about {_mib(nbytes / 2**20)}{each}; {_mib(available)} of memory is available")


def _mib(mib: float) -> str:
    return f"{mib / 1024:,.1f} GiB" if mib >= 1024 else f"{mib:,.0f} MiB"


def shape(what: str, text: str) -> tuple[int, ...]:
    """One sample's shape from 'C,H,W' (or any number of dimensions)."""
    return int_list(what, text, "3,32,32")


def thread_count_variable() -> None:
    """OMP_NUM_THREADS, when set, is a positive whole number (and DDPKIT_THREADS a mode: see
    `thread_mode_variable`). torch and OpenMP keep 0 or a word
    without a word of their own, and every process then takes all the cores (many times slower
    on a CPU with several processes)."""
    thread_mode_variable()
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or not value.strip() or (value.strip().isdigit() and int(value) > 0):
        return  # unset, or set empty (as `export OMP_NUM_THREADS=` does): the default
    raise UsageError(
        f"OMP_NUM_THREADS={shown(value, 40)}: not a positive whole number of threads per process; unset it (ddpkit gives "
        "each process its share of the cores) or set a count such as 1"
    )


def thread_mode_variable() -> None:
    """DDPKIT_THREADS, when set, is `share` (or empty: ddpkit's choice by the load); a typo would
    otherwise be the default without a word."""
    value = os.environ.get("DDPKIT_THREADS", "").strip()
    if value not in ("", "share"):
        raise UsageError(
            f"DDPKIT_THREADS={shown(value, 40)}: 'share' (each process its share of the cores, whatever "
            "the load) or unset (ddpkit also leaves out the cores other programs keep busy)"
        )
