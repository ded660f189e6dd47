"""The argument parser every command uses: an argparse error is one line and exit code 2.

Three rules on top of argparse, for every command:
- no abbreviations: `--epoch 3` is an unknown flag, not `--epochs` (a flag added later could
  otherwise silently change what an old command line or script means);
- an unknown flag is one line that suggests the closest known one ("did you mean --epochs?");
- numbers are checked as they are read: an integer fits in int64 (what torch and NumPy take;
  larger ones would fail later with an overflow traceback) and a float is finite, so NaN or inf
  never reaches a check that compares it.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from ..core.checks import INT64


def _int(text: str) -> int:
    value = int(text)  # a ValueError: argparse says "invalid int value: 'abc'"
    if not INT64[0] <= value <= INT64[1]:
        raise argparse.ArgumentTypeError(f"{text} is out of range (an integer of at most {INT64[1]})")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def did_you_mean(unknown: Iterable[str], known: Iterable[str], argv: Sequence[str] = ()) -> str:
    """argparse's 'unrecognized arguments' line, with the closest known flag for each unknown
    one, and the flag a stray value such as `-inf` was meant for (argparse reads a word that
    starts with '-' and is not a plain number as a flag)."""
    unknown, known, argv = list(unknown), sorted(known), list(argv)
    hints = []
    for arg in unknown:
        flag = _flag_before(arg, argv, known)
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if arg.startswith("-") else []
        if flag:
            hints.append(f"{arg}: a value of {flag}? write {flag}={arg}")
        elif close:
            hints.append(f"{name}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


def _flag_before(arg: str, argv: list[str], known: list[str]) -> str | None:
    """The known flag just before `arg` in `argv` when `arg` is a number, else None."""
    try:
        float(arg)
        i = argv.index(arg)
    except ValueError:
        return None
    return argv[i - 1] if i > 0 and argv[i - 1] in known else None


class OneLineErrors:
    """Mixin for argparse parsers: the rules above, and every error as one line and exit code 2
    (argparse itself prints the usage too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        # argparse looks `type=int` up in this registry before calling it: every integer and
        # float flag (a benchmark's own ones too) gets the checks above.
        self.register("type", int, _int)  # type: ignore[attr-defined]
        self.register("type", float, _float)  # type: ignore[attr-defined]

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(argv, namespace)  # type: ignore[attr-defined]
        if extra:
            self.error(did_you_mean(extra, self._option_string_actions, argv))  # type: ignore[attr-defined]
        return parsed

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)  # type: ignore[attr-defined]
        raise SystemExit(2)


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    pass


def given(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> list[str]:
    """The settings in `namespace` set away from `parser`'s defaults, by destination ("gpt_width")."""
    return [dest for dest, value in vars(namespace).items() if value != parser.get_default(dest)]
