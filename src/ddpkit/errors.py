"""Exceptions that carry meaning for the command line.

`UsageError` is bad input (a flag, a file): the CLI prints its message on one line and exits 2.
`WorkerFailed` is a failure during the run: the CLI names the failing rank and exits 1.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class UsageError(ValueError):
    """Bad usage or bad input; the message names the flag or file at fault."""


class IncompatibleCheckpoint(UsageError):
    """A readable checkpoint that this run's settings cannot continue (resuming it would
    silently train something else): never skipped over by `--resume auto`."""


class NotSaveState(UsageError):
    """`rt.load_state` was given a checkpoint that `rt.save_state` did not write (nothing of it
    was loaded): `rt.load` reads it, and `ddpkit train` reads its own checkpoints of ddpkit 0.1."""


class RunError(RuntimeError):
    """A failure during the run that its message explains whole (a full disk): the CLI prints
    it as one line naming the rank, without a traceback, and exits 1."""


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
    """One or more worker processes failed; `rank` is the one that caused it.

    `what` completes the sentence "rank R (pid P) on HOST ...", or "rank R (dp=1,tp=0, pid P)
    on HOST ..." on a mesh: "failed: ValueError: boom",
    "was killed by SIGKILL (out of memory?)". `traceback` is that rank's Python traceback, or
    its stack when it was stopped or crashed."""

    def __init__(
        self,
        rank: int,
        host: str,
        what: str,
        exitcode: int | None = None,
        traceback: str = "",
        pid: int | None = None,
        where: str = "",
    ):
        self.rank, self.host, self.exitcode, self.traceback, self.pid = rank, host, exitcode, traceback, pid
        self.where = where
        super().__init__(f"{who(rank, pid, where)} on {host} {what}")


def who(rank: int, pid: int | None = None, where: str = "") -> str:
    """'rank 3 (dp=1,tp=1, pid 812)': a rank, its mesh coordinates and its pid, where known."""
    said = ", ".join(part for part in (where, f"pid {pid}" if pid else "") if part)
    return f"rank {rank}" + (f" ({said})" if said else "")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM reached the launching process: its workers are gone. The CLI
    prints one line (with `note`, e.g. the last checkpoint) and exits 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGINT, note: str = ""):
        self.signum, self.note = int(signum), note
        super().__init__(signal.Signals(signum).name)


def interrupt_behind(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM) that was unwinding when `err` was raised, if one was (not one
    that code caught and replaced, `raise ... from None`)."""
    seen: set[int] = set()
    while not err.__suppress_context__ and err.__context__ is not None and id(err) not in seen:
        seen.add(id(err))
        err = err.__context__
        if isinstance(err, KeyboardInterrupt):
            return err
    return None
