"""The rank that caused a failed attempt, rather than the first one the agent noticed.

Each rank of the attempt is read from what it left (see `records`) and torch's error files,
and sorted into one of these, the first being the cause:

1. it raised an error of its own (told by torch's error file, or by the record its Runtime
   wrote as it closed, should the agent have stopped it before torch wrote that file), was
   killed by a signal other than the agent's SIGTERM (SIGKILL from the out-of-memory killer,
   SIGSEGV), exited with a code, or was frozen (stopped by SIGSTOP and never continued):
   earliest first;
2. it vanished: no error, no exit status, no stack (a SIGKILL the launcher did not see);
3. it hung: another rank timed out waiting for it in a collective, and it was still busy
   elsewhere when the agent stopped it; its stack shows where;
4. it failed because a peer did (connection reset, a timeout while waiting);
5. the agent stopped it (it died of the agent's SIGTERM, or of a crash while it dumped its
   stack for that SIGTERM).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import socket
from dataclasses import dataclass
from typing import Any

from ..errors import WorkerFailed, who
from .records import LAUNCH_DIR, RankRecord, agent_stop_after, current_attempt, read_attempt, signal_name

# Errors a healthy rank raises because a peer died under it. They are consequences, not causes.
_PEER_LOSS = (
    "Connection closed by peer",
    "remote worker crashing",
    "Connection reset by peer",
    "DistBackendError",
    "DistNetworkError",
    "failed to recv",
    "NCCL communicator was aborted",
    "remote process exited",
    "Broken pipe",
)
_WHOLE = "ddpkit.errors.RunError: "  # the last traceback line of a failure explained by its message
# A collective that gave up waiting for a peer (gloo, the c10d store, NCCL's watchdog); not any
# error that mentions a timeout (a user's own TimeoutError is a cause).
_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Socket Timeout|collective operation timeout|DistStoreError.*[Tt]imeout")
# Frames of a rank that is waiting in a collective, not stuck in work of its own.
_WAITING = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/", "torch/_tensor.py")


@dataclass(frozen=True)
class Ending:
    """How one rank's attempt ended, as far as the records tell."""

    rank: int
    pid: int | None
    status: int | None  # exit code, or minus the signal
    when: float
    traceback: str  # its own Python error, if it raised one
    stack: str  # its stack when stopped or crashed
    frozen: str = ""  # the signal that stopped it, when it was never continued
    outside: bool = False  # it died of SIGTERM before the agent began to stop workers
    where: str = ""  # its mesh coordinates, where it said them

    @property
    def kind(self) -> str:
        if self.frozen and self.status != 0:
            return "frozen"
        if self.traceback:
            if _TIMEOUT.search(self.traceback):
                return "waited"
            return "consequence" if any(m in self.traceback for m in _PEER_LOSS) else "raised"
        if self.status is not None:
            if self.status == -signal.SIGTERM and not self.outside:
                return "stopped"
            return "ok" if self.status == 0 else ("signal" if self.status < 0 else "exited")
        if self.stack.startswith("Fatal Python error"):
            return "signal"
        return "stopped" if self.stack else "vanished"


def as_worker_failed(err: Any, logs: str, attempt: int) -> WorkerFailed:
    """The `WorkerFailed` for torch's ChildFailedError `err` of attempt `attempt`."""
    reported = {rank: (f.exitcode, f.pid, _traceback_of(f.error_file_data)) for rank, f in err.failures.items()}
    offset = next((rank - f.local_rank for rank, f in err.failures.items()), 0)
    cause = blame(logs, attempt, reported, offset)
    if cause is None:  # nothing recorded at all: the agent's own report
        rank, (exitcode, pid, tb) = min(reported.items())
        cause = Ending(rank, pid, exitcode, 0.0, tb, "")
    what, trace = describe(cause, endings(logs, attempt, reported, offset))
    return WorkerFailed(cause.rank, socket.gethostname(), what, cause.status, trace, cause.pid, cause.where)


def restart_cause(logs: str, attempt: int) -> str:
    """Why attempt `attempt` ended, for the line a restart prints: 'rank 1 (pid N) was killed
    by SIGKILL (out of memory?)'. Read by the next attempt's workers on this node."""
    cause = blame(logs, attempt, {}, 0)
    elsewhere = int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cause is None or (elsewhere and cause.kind in ("stopped", "consequence", "waited")):
        return "a rank on another node failed"  # this node's ranks were only stopped, or lost it
    what, _ = describe(cause, endings(logs, attempt, {}, 0))
    return f"{who(cause.rank, cause.pid, cause.where)} {what}"


def restart_note() -> str | None:
    """In a restarted worker: 'restart k of K: <why the previous attempt ended>' (None on the
    first attempt)."""
    attempt = current_attempt()
    if not attempt:
        return None
    logs, most = os.environ.get(LAUNCH_DIR), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    cause = restart_cause(logs, attempt - 1) if logs else "a worker failed"
    return f"restart {attempt} of {most}: {cause}"


def endings(logs: str, attempt: int, reported: dict[int, tuple[int, int, str]], offset: int) -> dict[int, Ending]:
    """Every rank of this node's attempt: the records, torch's error files, the agent's report."""
    records = read_attempt(logs, attempt)
    errors = _error_files(logs, attempt, offset)
    stop = agent_stop_after(logs, min((r.started for r in records.values()), default=0.0))
    out = {}
    for rank in sorted(set(records) | set(errors) | set(reported)):
        rec = records.get(rank, RankRecord(rank))
        exitcode, pid, tb = reported.get(rank, (None, None, ""))
        when, file_tb = errors.get(rank, (float("inf"), ""))
        tb = tb or file_tb
        status = rec.status if rec.status is not None else exitcode
        if rec.done and status is None:
            status = 0
        if rec.raised and not rec.done and status != 0:  # it was failing with this error when its Runtime closed
            tb, when = tb or rec.raised, min(when, rec.raised_at)
        status = _stopped_mid_dump(status, rec.stack)
        ended = rec.frozen_at if rec.frozen else min(rec.ended, when)  # a frozen rank stopped working then
        out[rank] = Ending(rank, rec.pid or pid, status, ended, tb, rec.stack, rec.frozen, where=rec.where)
    # A SIGTERM came from outside when it killed a rank before anything else ended: the agent
    # stops workers only once one has ended (torch's process context SIGTERMs the rest as it
    # notices a failure, before its `close`, which `stops` records), or begun to stop them.
    for rank, e in out.items():
        if stop is None or e.status != -signal.SIGTERM or not e.when < stop:
            continue
        if not any(_may_have_ended_before(o, e) for o in out.values() if o.rank != rank and o.kind != "ok"):
            out[rank] = dataclasses.replace(e, outside=True)
    return out


def _stopped_mid_dump(status: int | None, stack: str) -> int | None:
    """A rank that crashed (SIGSEGV) while it dumped its stack for a SIGTERM died of that
    SIGTERM: faulthandler reads the main thread's frames while it runs on, when the signal was
    taken by another thread, and may crash doing so (most likely what CI saw under `--mesh
    pp=2`: rank 0, stopped by the agent after rank 1 was SIGKILLed, was blamed, "killed by
    SIGSEGV"). Only SIGTERM writes a dump without a header; a crash's starts "Fatal Python
    error", so such a stack is the SIGTERM's dump followed by the crash's. A SIGKILL after a
    SIGTERM's dump is the agent's, after its grace. (A crash before the dump's first line is
    written reads as a crash.)"""
    if status is None or status >= 0 or status == -signal.SIGTERM or not stack:
        return status
    if stack.startswith("Fatal Python error"):
        return status
    return -signal.SIGTERM if "Fatal Python error" in stack or status == -signal.SIGKILL else status


def _may_have_ended_before(other: Ending, e: Ending) -> bool:
    """Whether `other` may have ended before `e`: it did, or when it ended is not known and it
    did not die of the agent's SIGTERM (a rank SIGKILLed and reaped by the agent before the
    launcher's watch looked: the agent then SIGTERMs the rest, before its stops are recorded)."""
    if other.when <= e.when:
        return True
    unknown = other.when == float("inf")
    return unknown and (other.kind == "vanished" or other.status not in (None, 0, -signal.SIGTERM))


def blame(logs: str, attempt: int, reported: dict[int, tuple[int, int, str]], offset: int) -> Ending | None:
    ranks = [e for e in endings(logs, attempt, reported, offset).values() if e.kind != "ok"]
    if not ranks:
        return None
    waited = any(e.kind == "waited" for e in ranks)

    def order(e: Ending) -> tuple[int, float, int]:
        if e.kind in ("raised", "signal", "exited", "frozen"):
            return (0, e.when, e.rank)
        if e.kind == "vanished":
            return (1, e.when, e.rank)
        if waited and e.kind == "stopped":
            busy = not any(frame in e.stack for frame in _WAITING)
            return (2 if busy else 3, e.when, e.rank)
        return (4 if e.kind in ("waited", "consequence") else 5, e.when, e.rank)

    return min(ranks, key=order)


def describe(cause: Ending, everyone: dict[int, Ending]) -> tuple[str, str]:
    """What happened to the causing rank ("failed: ValueError: boom", "was killed by SIGKILL
    (out of memory?)") and the trace to show with it."""
    kind = cause.kind
    last = _last_line(cause.traceback)
    if kind == "raised" and last.startswith(_WHOLE):  # errors.RunError: its message says it all
        return f"failed: {last.removeprefix(_WHOLE)}", ""
    if kind in ("raised", "waited", "consequence"):
        return f"failed: {last}", cause.traceback
    if kind == "signal":
        name = signal_name(-cause.status) if cause.status is not None else _crash_name(cause.stack)
        hints = {"SIGKILL": " (out of memory?)", "SIGTERM": " (not from the launcher: kill, a scheduler?)"}
        hint = hints.get(name, "")
        return f"was killed by {name}{hint}", cause.stack
    if kind == "exited":
        return f"exited with code {cause.status} without a Python error", ""
    if kind == "vanished":
        return "was killed by a signal it could not catch (SIGKILL? out of memory?)", ""
    waiter = min((e for e in everyone.values() if e.kind == "waited"), key=lambda e: (e.when, e.rank), default=None)
    if kind == "frozen":
        why = (
            f"rank {waiter.rank} gave up waiting for it ({_last_line(waiter.traceback)})" if waiter else "the run ended"
        )
        stack = f"Stack of rank {cause.rank} when it was stopped:\n{cause.stack}" if cause.stack else ""
        return (
            f"hung: it was stopped by {cause.frozen} and never continued, until {why}"
            + ("; its stack is above" if stack else ""),
            stack,
        )
    if waiter is not None:
        return (
            f"hung: it never reached the collective that rank {waiter.rank} gave up waiting for "
            f"({_last_line(waiter.traceback)}); "
            f"its stack when stopped is above",
            f"Stack of rank {cause.rank} when it was stopped:\n{cause.stack}",
        )
    return "was stopped by the launcher", cause.stack


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def _error_files(logs: str, attempt: int, offset: int) -> dict[int, tuple[float, str]]:
    """torch's error files of one attempt: global rank -> (modification time, traceback).
    The files' own timestamps are whole seconds; the modification time is finer."""
    out = {}
    for path in glob.glob(os.path.join(logs, "*", f"attempt_{attempt}", "*", "error.json")):
        try:
            with open(path) as f:
                tb = _traceback_of(json.load(f))
            when = os.path.getmtime(path)
        except (OSError, ValueError):
            continue
        if tb:
            out[offset + int(os.path.basename(os.path.dirname(path)))] = (when, tb)
    return out


def _traceback_of(error_file_data: Any) -> str:
    data = error_file_data.get("message", {}) if isinstance(error_file_data, dict) else {}
    return data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""


def _crash_name(stack: str) -> str:
    """'Fatal Python error: Segmentation fault' -> 'SIGSEGV' (faulthandler names the signal)."""
    names = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
             "Floating-point exception": "SIGFPE", "Illegal instruction": "SIGILL"}  # fmt: skip
    first = stack.splitlines()[0] if stack else ""
    return next((sig for text, sig in names.items() if text in first), "a fatal signal")
