"""What each worker of a launch leaves behind, so that the launcher can tell how it ended.

torch's agent reports one failure: the first it notices, which may be a rank that failed
*because* another died. And a worker that dies by a signal writes no error file. So every
worker of a launch keeps a small record in the launch's folder (DDPKIT_LAUNCH_DIR), one
folder per attempt (the agent's restart count):

- `rank-R.pid`: its pid, written when it starts;
- `rank-R.stack`: its Python stack, dumped by `faulthandler` when it is stopped (SIGTERM, the
  agent's stop signal) or crashes (SIGSEGV, SIGABRT, ...): where a hung rank was stuck;
- `rank-R.done`: it returned normally;
- `rank-R.raised`: the traceback of the error it was failing with when its Runtime closed,
  written before the process group went (`note_raised`);
- `rank-R.exit`: how it ended, from the parent (`ExitWatch`): the exit status peeked with
  `waitid(WNOWAIT)` when SIGCHLD arrives, so that the agent still reaps it as usual;
- `rank-R.frozen`: it was stopped by a signal (SIGSTOP, Ctrl-Z's SIGTSTP) and not continued,
  from the parent too: a frozen rank cannot dump its stack nor die of the agent's SIGTERM.

And the launcher notes in `stops` when its agent begins to stop the workers (`agent_stops`): a
worker that died of SIGTERM before then got it from outside (`kill`, a scheduler).

Every time these records are compared by is a file's modification time, never `time.time()`:
a dumped stack's time is the file system's, which trails the system clock by up to a tick of
the kernel's coarse clock (8 ms measured here), so a rank the agent SIGTERMed after another
died could seem to have died before the other's end was stamped with `time.time()`. Times from
one clock keep their order (ties are possible, and read as "may have come first").
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import glob
import json
import os
import re
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..core.signals import set_handler
from ..errors import interrupt_behind

LAUNCH_DIR = "DDPKIT_LAUNCH_DIR"

_stack_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def attempt_dir(root: str, attempt: int) -> str:
    return os.path.join(root, f"attempt-{attempt}")


def current_attempt() -> int:
    """How many times the elastic agent has restarted this job's workers (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def arm() -> None:
    """In a worker: record its pid and arm the stack dump (nothing outside a ddpkit launch)."""
    global _stack_file
    root, rank = os.environ.get(LAUNCH_DIR), os.environ.get("RANK")
    if not root or rank is None:
        return
    _die_with_the_launcher()
    folder = attempt_dir(root, current_attempt())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    _stack_file = open(os.path.join(folder, f"rank-{rank}.stack"), "w")  # noqa: SIM115 - lives as long as the worker
    # chain: after the dump, SIGTERM does what it did before (the default: the process ends).
    faulthandler.register(signal.SIGTERM, file=_stack_file, all_threads=True, chain=True)
    # A crash's dump goes there too (not to the console): the launcher shows it with the failure.
    faulthandler.enable(file=_stack_file, all_threads=True)


def _die_with_the_launcher() -> None:
    """If the launching process dies (SIGKILL, a node's OOM killer), its workers die too, as
    the agent would have stopped them: orphans would go on training and writing --out beside
    the next run, which takes over its lock. Linux only (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def note_place(where: str) -> None:
    """In a worker: its coordinates on the job's mesh ("dp=1,tp=0"), for the failure report."""
    root, rank = os.environ.get(LAUNCH_DIR), os.environ.get("RANK")
    if root and rank is not None:
        path = os.path.join(attempt_dir(root, current_attempt()), f"rank-{rank}.where")
        if where:
            with open(path, "w") as f:
                f.write(where)
        else:  # a Runtime without a mesh after one with: its coordinates no longer hold
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def mark_done() -> None:
    """In a worker whose function returned: it did not fail."""
    root, rank = os.environ.get(LAUNCH_DIR), os.environ.get("RANK")
    if root and rank is not None:
        open(os.path.join(attempt_dir(root, current_attempt()), f"rank-{rank}.done"), "w").close()


def note_raised(exc: BaseException | None = None) -> None:
    """In a worker whose Runtime closes while an error unwinds (`with Runtime(...)` left by an
    exception, `exc`; or `close()` in a `finally`, the error being handled): that error's
    traceback, before the process group goes. Its peers fail at once then ("Connection closed
    by peer"), and the agent may stop this rank with SIGTERM before torch's `record` has
    written its error file: the launcher would see a rank it stopped, and blame the peer.
    Only an `Exception` of the rank's own, as torch's `record` (for a function; a script's
    wrapper writes its error file likewise): a KeyboardInterrupt or SystemExit is not a rank's
    error, nor an error raised while a Ctrl-C unwinds. Noted once (its time is when the Runtime
    began to close), whole or not at all; a new Runtime forgets it (`forget_raised`)."""
    exc = sys.exc_info()[1] if exc is None else exc
    root, rank = os.environ.get(LAUNCH_DIR), os.environ.get("RANK")
    if not root or rank is None or not isinstance(exc, Exception) or getattr(exc, _NOTED, False):
        return
    with contextlib.suppress(Exception):  # a record less, never an error of its own over the rank's
        if interrupt_behind(exc):
            return
        path = os.path.join(attempt_dir(root, current_attempt()), f"rank-{rank}.raised")
        with open(path + ".part", "w") as f:
            f.write("".join(traceback.format_exception(exc)))
        os.replace(path + ".part", path)
        setattr(exc, _NOTED, True)  # (a mark on it, not a reference that would keep its frames alive)


_NOTED = "_ddpkit_noted"


def forget_raised() -> None:
    """In a worker making a Runtime: an error noted as an earlier one closed was caught, and the
    rank went on; it is no longer what the rank would fail with."""
    root, rank = os.environ.get(LAUNCH_DIR), os.environ.get("RANK")
    if root and rank is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(attempt_dir(root, current_attempt()), f"rank-{rank}.raised"))


@dataclass(frozen=True)
class RankRecord:
    rank: int
    pid: int | None = None
    status: int | None = None  # exit code, or minus the signal's number (as Popen's returncode)
    ended: float = float("inf")  # when the parent saw it end (a file's time: see above)
    stack: str = ""
    done: bool = False
    raised: str = ""  # the traceback of the error its Runtime closed on (`note_raised`)
    raised_at: float = float("inf")
    frozen: str = ""  # the signal that stopped it, if it was stopped and not continued
    frozen_at: float = float("inf")
    started: float = float("inf")  # when it wrote its pid
    where: str = ""  # its coordinates on the mesh, where the job has one ("dp=1,tp=0")


def read_attempt(root: str, attempt: int) -> dict[int, RankRecord]:
    """The records of one attempt's workers on this node, by global rank."""
    folder = attempt_dir(root, attempt)
    ranks = (
        {int(m.group(1)) for p in os.listdir(folder) if (m := re.match(r"rank-(\d+)\.", p))}
        if os.path.isdir(folder)
        else set()
    )
    return {rank: _read_rank(folder, rank) for rank in sorted(ranks)}


def _read_rank(folder: str, rank: int) -> RankRecord:
    def text(suffix: str) -> str:
        try:
            with open(os.path.join(folder, f"rank-{rank}.{suffix}"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    pid = text("pid")
    started = _mtime(os.path.join(folder, f"rank-{rank}.pid"))
    exit_, frozen = _json(text("exit")), _json(text("frozen"))
    stack = text("stack").strip()
    # When the watch saw it end: its record's time. Not known: no record, or the agent's report only.
    ended = _mtime(os.path.join(folder, f"rank-{rank}.exit")) if exit_.get("seen") else float("inf")
    if stack and (exit_.get("status") or 0) < 0:
        # Killed by a signal whose handler dumped the stack: it got the signal when the dump was
        # written. The parent's time is when its SIGCHLD watch looked, which under load may look
        # once for several deaths and stamp them in the order of their records, not of their ends.
        ended = min(ended, _mtime(os.path.join(folder, f"rank-{rank}.stack")))
    return RankRecord(
        rank=rank,
        pid=int(pid) if pid.isdigit() else None,
        status=exit_.get("status"),
        ended=ended,
        stack=stack,
        done=os.path.exists(os.path.join(folder, f"rank-{rank}.done")),
        raised=text("raised"),
        raised_at=_mtime(os.path.join(folder, f"rank-{rank}.raised")),
        frozen=str(frozen.get("signal", "")),
        frozen_at=_mtime(os.path.join(folder, f"rank-{rank}.frozen")) if frozen else float("inf"),
        started=started,
        where=text("where").strip(),
    )


STOPS = "stops"  # in a launch's folder: a file for each time its agent began to stop workers, made then


def _mtime(path: str) -> float:
    """When `path` was last written, on the file system's clock (infinity if it is not there)."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return float("inf")


@contextlib.contextmanager
def agent_stops(root: str) -> Iterator[None]:
    """While the agent runs, note in the folder `root`/STOPS each time it begins to stop its
    workers (its process context's `close`: after a failure, before a restart, at the end), as a
    file made then. The folder exists from the start: its absence means the stops went
    unrecorded (a torch without that method)."""
    try:
        from torch.distributed.elastic.multiprocessing.api import (
            PContext,
        )  # the elastic agent's, in the launching process alone
    except ImportError:
        yield
        return
    own = getattr(PContext, "close", None)
    if own is None:
        yield
        return
    path = os.path.join(root, STOPS)

    def close(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(OSError):
            os.close(tempfile.mkstemp(prefix="stop-", dir=path)[0])
        return own(self, *args, **kwargs)

    own_wait = getattr(PContext, "wait", None)

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own_wait(self, *args, **kwargs)
        with contextlib.suppress(Exception):  # a record less, never a launch broken by it
            note_failures(root, getattr(result, "failures", None) or {})
        return result

    os.makedirs(path, exist_ok=True)
    PContext.close = close
    if own_wait is not None:
        PContext.wait = wait
    try:
        yield
    finally:
        PContext.close = own
        if own_wait is not None:
            PContext.wait = own_wait


def note_failures(root: str, failures: dict[int, Any]) -> None:
    """The exit status of each failed worker the agent saw (torch's ProcessFailure: its pid and
    exit code, minus the signal), written as its `.exit` record where the SIGCHLD watch wrote
    none: the agent reaped it before the watch looked, which under load happens. When it ended
    is not known (at some moment before now): the record says it was not seen."""
    pids = {int(f.pid): int(f.exitcode) for f in failures.values() if getattr(f, "pid", None)}
    for _, record, pid in worker_records(root) if pids else ():
        if pid in pids and not os.path.exists(record + ".exit"):
            with open(record + ".exit", "w") as f:
                json.dump({"status": pids[pid], "seen": False}, f)


def worker_records(root: str) -> Iterator[tuple[str, str, int]]:
    """(its .pid file, its record's path without a suffix, its pid) of every worker of every
    attempt of the launch in `root` that has written its pid."""
    for path in glob.glob(os.path.join(root, "attempt-*", "rank-*.pid")):
        try:
            with open(path) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        yield path, path[: -len(".pid")], pid


def agent_stop_after(root: str, since: float) -> float | None:
    """When the agent first began to stop workers at or after `since`: infinity if it has not,
    None if its stops were not recorded."""
    folder = os.path.join(root, STOPS)
    try:
        times = [_mtime(os.path.join(folder, name)) for name in os.listdir(folder)]
    except OSError:
        return None
    return min((t for t in times if t >= since), default=float("inf"))


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ExitWatch:
    """In the launching process: how each of this launch's workers ended.

    On SIGCHLD, peek at every known worker's exit status with `waitid(..., WNOWAIT)`: the
    status stays for the agent, which reaps its children as before. Only from the main thread
    (where Python runs signal handlers); elsewhere the records simply lack exit statuses.

    SIGCHLD also comes when a worker is stopped by a signal, or continued. A stopped worker is
    recorded (`rank-R.frozen`) and said at once: its peers will wait for it until their
    collective timeout. Once one of the attempt's workers has failed the attempt is over, and
    a worker still stopped is ended as the agent would end it, with SIGTERM, then continued so
    that it can take it: it dumps its stack (where it froze, or a moment after) and dies at once, instead of being
    SIGKILLed after the agent's 30 s grace with no stack at all.
    """

    def __init__(self, root: str):
        self.root = root
        self.seen: set[str] = set()  # pid files done with (a pid may come back in a later attempt)
        self.ended: set[str] = set()  # stopped workers this watch ended: continued by it, still frozen
        self.failing: set[str] = set()  # attempt folders in which a worker has ended without success

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or not hasattr(os, "waitid"):
            yield
            return
        previous = set_handler(signal.SIGCHLD, self._on_child)
        try:
            yield
        finally:
            set_handler(signal.SIGCHLD, previous)
            self._on_child()  # a last look, for a child that ended just now

    def _on_child(self, *_: Any) -> None:
        frozen: dict[str, int] = {}  # the workers stopped now: record path -> pid
        for path, record, pid in worker_records(self.root):
            if path in self.seen:
                continue
            attempt = os.path.dirname(path)
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped (by the agent, before this look), or another node's
                if not os.path.exists(record + ".done"):
                    self.failing.add(attempt)
                continue
            if info is None:  # still running, or stopped
                if self._stopped(record, pid):
                    frozen[record] = pid
                continue
            self.seen.add(path)
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            status = -info.si_status if killed else info.si_status
            if status != 0:
                self.failing.add(attempt)
            with open(record + ".exit", "w") as f:
                json.dump({"status": status, "seen": True}, f)  # seen now: the file's time says when
        for record, pid in frozen.items():  # in an attempt that is over: ended, with their stacks
            if os.path.dirname(record) in self.failing and record not in self.ended:
                self.ended.add(record)
                _end_frozen(pid)

    def _stopped(self, record: str, pid: int) -> bool:
        """Whether worker `pid` is stopped now; its `.frozen` record says so, written when it
        is first seen stopped (and said on stderr), removed when it is seen continued."""
        try:
            info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WCONTINUED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        path = record + ".frozen"
        if info is None or info.si_code != os.CLD_STOPPED:
            if info is not None and record not in self.ended and os.path.exists(path):  # continued (SIGCONT)
                os.remove(path)
            return False
        name = signal_name(info.si_status)
        try:  # made once (this handler may run inside itself): its maker alone says it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return True
        with os.fdopen(fd, "w") as f:
            json.dump({"signal": name}, f)  # stopped by now: the file's time says when
        rank = os.path.basename(record).removeprefix("rank-")
        line = (
            f"ddpkit: rank {rank} (pid {pid}) was stopped by {name}: its peers wait for it until their "
            "collective timeout (SIGCONT it to go on)\n"
        )
        # os.write, not print: this runs in a signal handler, perhaps inside a write to stderr
        with contextlib.suppress(OSError, ValueError, AttributeError):  # (a stderr without a descriptor)
            os.write(sys.stderr.fileno(), line.encode())
        return True


def _end_frozen(pid: int) -> None:
    """End a stopped worker as the agent would, and let it run to take the signal.

    Continued first, then signalled: Linux hands a signal sent to a running process to its
    main thread, whose Python frames hold still while faulthandler dumps them. Sent while it
    was stopped, the SIGTERM waited, and whichever thread woke first took it (a gloo thread, say),
    so faulthandler read the main thread's frames while that thread ran on: once in a whole run of
    the suite under --processes, the worker crashed mid-dump (SIGSEGV; its stack file ended at
    the first frame's file name)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)


def signal_name(number: int) -> str:
    """'SIGKILL' for 9; 'signal 64' for a number that names none."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
