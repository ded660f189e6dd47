"""Turning the elastic agent's report of a failed job into one `WorkerFailed` naming the rank
that caused it, rather than the first one the agent noticed."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
from typing import Any

from ..errors import WorkerFailed

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
)


def as_worker_failed(err: Any, logs: str) -> WorkerFailed:
    """The root cause among all ranks that failed: a rank's own exception beats a peer-loss
    error or a kill by the agent; then the earliest; then the lowest rank."""
    # rank -> (exitcode, when, traceback). The error files' own timestamps are whole seconds,
    # so when is the file's modification time, which has sub-second resolution.
    found: dict[int, tuple[int, float, str]] = {}
    # Error files are per local rank; the failures the agent reports give this node's offset.
    offset = next((rank - f.local_rank for rank, f in err.failures.items()), 0)
    for rank, failure in err.failures.items():
        when = os.path.getmtime(failure.error_file) if os.path.isfile(failure.error_file) else float("inf")
        found[rank] = (failure.exitcode, when, _traceback_of(failure.error_file_data))
    attempts = sorted(glob.glob(os.path.join(logs, "*", "attempt_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    for path in glob.glob(os.path.join(attempts[-1], "*", "error.json")) if attempts else []:
        rank = offset + int(os.path.basename(os.path.dirname(path)))
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        tb = _traceback_of(data)
        if tb and not found.get(rank, (0, 0.0, ""))[2]:
            found[rank] = (found.get(rank, (1, 0.0, ""))[0], os.path.getmtime(path), tb)

    def cause_first(item: tuple[int, tuple[int, float, str]]) -> tuple[bool, bool, float, int]:
        rank, (exitcode, stamp, tb) = item
        consequence = any(marker in tb for marker in _PEER_LOSS)
        # The agent stops the others with SIGTERM; any other signal (SIGKILL from the OOM
        # killer, SIGSEGV) is a cause in its own right.
        stopped_by_agent = exitcode == -signal.SIGTERM and not tb
        return (consequence, stopped_by_agent, stamp, rank)

    rank, (exitcode, _, tb) = min(found.items(), key=cause_first)
    if tb:
        message = tb.strip().splitlines()[-1]  # "ValueError: boom"; the traceback goes along
    elif exitcode < 0:
        message = f"killed by {_signal_name(-exitcode)}"
    else:
        message = f"exited with code {exitcode}"
    return WorkerFailed(rank, socket.gethostname(), message, exitcode, tb)


def _traceback_of(error_file_data: Any) -> str:
    data = error_file_data.get("message", {}) if isinstance(error_file_data, dict) else {}
    return data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
