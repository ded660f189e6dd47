"""Exceptions that carry meaning for the command line.

`UsageError` is bad input (a flag, a file): the CLI prints its message on one line and exits 2.
`WorkerFailed` is a failure during the run: the CLI names the failing rank and exits 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class UsageError(ValueError):
    """Bad usage or bad input; the message names the flag or file at fault."""


class IncompatibleCheckpoint(UsageError):
    """A readable checkpoint that this run's settings cannot continue (resuming it would
    silently train something else): never skipped over by `--resume auto`."""


@contextlib.contextmanager
def usage_errors(prefix: str = "") -> Iterator[None]:
    """A ValueError raised inside (by torch, or a model of the user's) is bad input: it leaves
    as a UsageError with `prefix` before its message."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(f"{prefix}{err}") from None


class WorkerFailed(RuntimeError):
    """One or more worker processes failed; `rank` is the first one that did."""

    def __init__(self, rank: int, host: str, message: str, exitcode: int | None = None, traceback: str = ""):
        self.rank, self.host, self.exitcode, self.traceback = rank, host, exitcode, traceback
        super().__init__(f"rank {rank} on {host} failed: {message}")
