"""`ddpkit` command lines for the tests, each a process of its own forked from one interpreter that
imported torch once (`run_cli` in tests/conftest.py uses it).

A fresh `python -m ddpkit train` spends about 2 s of CPU importing torch and its compiler before
it does anything, and the suite runs some 200 command lines. So each test process starts one
server (`python -m tests.cli_server`, from the repository, with the session's environment as it
started) that imports torch, its compiler and ddpkit's command line and then only waits. For
each command line it forks; the child takes the command's stdin, stdout and stderr (files of the
test process, passed over a Unix socket), its working directory and environment, and runs the
module as `__main__` exactly as `python -m MODULE ARGS...` would (`runpy`, `sys.argv`, the
working directory first on `sys.path`), to the interpreter's own ending (tests/as_main.py). The
test gets what `subprocess.run` gives: the exit code (minus the signal that killed the command),
its output as text with the newlines translated, `TimeoutExpired` after killing it past its
timeout.

What differs from a fresh interpreter is only what the server imported before forking, which a
command imports anyway, with the environment it had then. So a command line whose environment
differs from the server's in anything read when a module is imported (OMP_NUM_THREADS, torch's
own variables, LD_PRELOAD...) runs as a fresh interpreter instead (`forkable`): only what is read
as a command runs may differ (RUNTIME_VARIABLES, RUNTIME_PREFIXES), and PYTHONPATH where it puts
folders before the session's (a folder of a test's own modules, the repository for the tests'
runners of many cases): the fork puts them on `sys.path` where a fresh interpreter does. So
does every command line when TESTS_CLI_EXEC=1 is set, to run the suite the old way, and one
that asks (`fresh`: the session's shared run, as a user starts it).

A command a test starts in the background, to signal it, kill its workers or run beside another
(`start_cli` in tests/conftest.py), is forked the same way (`popen`): a `Forked` is a
`subprocess.Popen` whose process the server forked, with the same pipes, `poll`, `wait`,
`communicate` and signals by pid or process group; the server runs several at once and tells
each one's end. The tests of what starting a command costs or loads (`--help` without torch, the
progress bar on a terminal, a signal while the launcher imports torch's compiler) start their own
interpreters.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from tests.as_main import ignored_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# What the server runs as `python -m`: the commands, and the tests' runners of many cases in one
# interpreter (tests/cli/argv_runner.py, tests/docs/program_runner.py)
MODULES = ("ddpkit", "benchmarks", "tests.cli.argv_runner", "tests.docs.program_runner")
# What may differ from the server's environment: what is read as a command runs, never at an
# import. Besides ddpkit's own and the terminal's size: what pytest and torch set in the test
# process's environment as tests run there (the running test's name; torch's launcher's signals;
# the compiler's cache, read when it compiles; Intel OpenMP's settings, which this torch's GNU
# OpenMP never reads).
RUNTIME_VARIABLES = (
    "COLUMNS",
    "LINES",
    "PYTEST_CURRENT_TEST",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHINDUCTOR_CACHE_DIR",
)
RUNTIME_PREFIXES = ("DDPKIT_", "KMP_")
# What `popen` passes on to a forked command's Popen
FORKED_KEYWORDS = {"stdin", "stdout", "stderr", "text", "encoding", "errors", "cwd", "start_new_session"}
READ_S = 0.05  # how long a thread reads the socket before it lets another look (`_Server._taken`)
_MESSAGE = 1 << 20  # the largest request or reply, in bytes


class _Server:
    """The test process's server: its process and its end of the socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.ids = itertools.count()  # requests' numbers
        self.started: dict[int, int] = {}  # a request's number -> its command's pid, not yet taken
        self.ended: dict[int, int] = {}  # a command's pid -> its exit code, not yet taken
        self.lock = threading.Lock()  # the socket's, and these answers'
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's own stderr, read if it fails
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        theirs.close()
        self.sock = ours
        try:
            # the CPU time of its imports, then of the commands it ran (theirs and their children's)
            self.cpu = self.reply(180)["cpu"]
        except BaseException:
            self.close()
            raise

    def reply(self, timeout: float | None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(_MESSAGE)
        except BlockingIOError:  # (a timeout of 0: nothing is waiting)
            raise TimeoutError from None
        if not data:
            self.log.seek(0)
            raise RuntimeError(f"the tests' command server ended: {self.log.read().decode(errors='replace')[-3000:]}")
        return json.loads(data)

    def start(self, module: str, args: Sequence[str], env: dict[str, str], cwd: str | None, fds: list[int],
              session: bool = False) -> int:  # fmt: skip
        """Fork `python -m MODULE ARGS...` with `fds` as its stdin, stdout and stderr (in a
        session of its own if `session`); its pid once it runs."""
        request = {
            "id": next(self.ids),
            "module": module,
            "args": list(args),
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "ignored": ignored_signals(),  # (a fresh interpreter inherits what this process ignores)
            "session": session,
        }
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        return self._taken(self.started, request["id"], None)

    def end(self, pid: int, timeout: float | None) -> int:
        """The exit code of the forked command `pid` (minus the signal that killed it), once it
        has ended; TimeoutError if it has not in `timeout` seconds (0: now)."""
        return self._taken(self.ended, pid, timeout)

    def _taken(self, answers: dict[int, int], key: int, timeout: float | None) -> int:
        """`answers[key]` (taken out) once the server has sent it; TimeoutError if it has not in
        `timeout` seconds (0: now). The test's threads share the socket (the bad-flag table runs
        its batches at once): each reads in turns of READ_S, filing whatever comes where it
        belongs, until its own answer is there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                if key in answers:
                    return answers.pop(key)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 and timeout != 0:
                    raise TimeoutError(key)
                try:
                    self._next(READ_S if left is None else max(0.0, min(left, READ_S)))
                except TimeoutError:
                    if timeout == 0:
                        raise

    def _next(self, timeout: float) -> None:
        """Read the server's next message: a command forked (its pid) or one ended (its exit
        code and CPU time). Raises TimeoutError when none comes in `timeout` (0: none waiting)."""
        message = self.reply(timeout)
        if "ended" in message:
            self.ended[message["ended"]] = message["code"]
            self.cpu += message["cpu"]
        else:
            self.started[message["id"]] = message["pid"]

    def run(
        self, module: str, args: Sequence[str], env: dict[str, str], cwd: str | None, stdin: str | None, timeout: float
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, *args]
        with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            if stdin is not None:
                source.write(stdin.encode(locale.getpreferredencoding(False)))  # as text=True encodes it
                source.seek(0)
            fds = [0 if stdin is None else source.fileno(), out.fileno(), err.fileno()]  # None: this process's own
            pid = self.start(module, args, env, cwd, fds)
            try:
                code = self.end(pid, timeout)
            except BaseException as exc:  # past its timeout, interrupted, failed: killed, as subprocess does
                with contextlib.suppress(ProcessLookupError):  # (unless it has just ended)
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(OSError, RuntimeError):  # (a server gone: this exception stands)
                    self.end(pid, 60)
                if isinstance(exc, TimeoutError):  # with what it wrote, as bytes (None: nothing), as subprocess does
                    raise subprocess.TimeoutExpired(cmd, timeout, _raw(out), _raw(err)) from None
                raise
            return subprocess.CompletedProcess(cmd, code, _text(out), _text(err))

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # the ends not taken yet: their CPU time
            while True:
                self._next(0)
        self.sock.close()  # the server ends when it reads the end of its socket
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _raw(f: Any) -> bytes | None:
    f.seek(0)
    return f.read() or None


def _text(f: Any) -> str:
    """A captured stream as `subprocess.run(text=True)` returns it: the locale's encoding, and
    universal newlines (a progress bar's carriage returns become newlines)."""
    f.seek(0)
    return io.TextIOWrapper(io.BytesIO(f.read())).read()


_server: list[_Server] = []  # this test process's, once a command line has needed it
counts = {"forked": 0, "fresh": 0}  # this test process's command lines, run each way
_environment: dict[str, str] = {}  # the server's environment: the session's, as it started (`start_with`)


def start_with(env: Mapping[str, str]) -> None:
    """Give the server, when it starts, the environment `env`: the test session's own (its
    start, never a test's changes: `tests/conftest.py`)."""
    _environment.clear()
    _environment.update(env)


def forkable(module: str, env: Mapping[str, str]) -> bool:
    """Whether `python -m MODULE` with `env` may be forked from the server: a module it runs,
    and an environment that differs from the server's only in what is read as a command runs."""
    if module not in MODULES or not _environment or os.environ.get("TESTS_CLI_EXEC") == "1":
        return False
    differ = {k for k in set(_environment) | set(env) if _environment.get(k) != env.get(k)}
    if _put_first(env.get("PYTHONPATH"), _environment.get("PYTHONPATH")) is not None:
        differ.discard("PYTHONPATH")  # folders put first: the fork puts them on its path (`_become`)
    return all(k in RUNTIME_VARIABLES or k.startswith(RUNTIME_PREFIXES) for k in differ)


def _put_first(path: str | None, servers: str | None) -> list[str] | None:
    """The folders PYTHONPATH `path` puts before the server's PYTHONPATH (`servers`), where it
    only adds folders in front (the tests' runners: a folder of the test's own modules, then the
    repository); else None. A fresh interpreter puts them on `sys.path` right after the working
    directory, and so does the fork (`_become`). What the server imported is not looked for
    again (a module of the same name there would not hide it): the tests' folders hold none."""
    mine, theirs = ([p for p in (value or "").split(os.pathsep) if p] for value in (path, servers))
    first = len(mine) - len(theirs)
    return mine[:first] if first >= 0 and mine[first:] == theirs else None


def run(
    module: str,
    args: Sequence[str],
    env: dict[str, str],
    cwd: str | None = None,
    stdin: str | None = None,
    timeout: float = 240,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...`, forked from the server (started now if need be) where
    `forkable`, else (or if `fresh`) a fresh interpreter: what `subprocess.run(...,
    capture_output=True, text=True)` returns."""
    if fresh or not forkable(module, env):
        counts["fresh"] += 1
        cmd = [sys.executable, "-m", module, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, input=stdin)
    counts["forked"] += 1
    try:
        return _started().run(module, args, env, cwd, stdin, timeout)
    except BaseException as exc:
        if not isinstance(exc, subprocess.TimeoutExpired):  # (its state unknown: a new server next time)
            close()
        raise


class Forked(subprocess.Popen):
    """`subprocess.Popen([python, "-m", MODULE, *ARGS], ...)` whose process is forked from the
    server (`popen`): the same pipes, files and text handling, `pid`, `poll`, `wait`,
    `communicate` and signals, the same exit code. Its own process ends are taken from the
    server, which waits for it (it is the server's child, not this process's)."""

    def __init__(self, server: _Server, module: str, args: Sequence[str], **kwargs: Any) -> None:
        self._server, self._module, self._argv = server, module, list(args)
        super().__init__([sys.executable, "-m", module, *args], **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # noqa: PLR0913
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        # (POSIX Popen's own step, with the server's fork where it forks and executes)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            self.pid = self._server.start(self._module, self._argv, dict(env), cwd, fds, bool(start_new_session))
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **_):  # (called by __del__ too: never raises)
        if self.returncode is None:
            try:
                self.returncode = self._server.end(self.pid, 0)
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the server gone: the end will never be known
                if _deadstate is not None:
                    self.returncode = _deadstate
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            try:
                self.returncode = self._server.end(self.pid, timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode


def popen(
    module: str, args: Sequence[str], env: dict[str, str], fresh: bool = False, **kwargs: Any
) -> subprocess.Popen:
    """`subprocess.Popen([python, "-m", MODULE, *ARGS], env=env, **kwargs)`: forked from the
    server where `forkable` (a `Forked`), else (or if `fresh`) a fresh interpreter. The
    server's fork gives the command stdin, stdout, stderr, a working directory, an environment
    and a session of its own (`start_new_session`), nothing else (no `pass_fds`, no
    `preexec_fn`)."""
    unknown = set(kwargs) - FORKED_KEYWORDS
    if unknown and not fresh:
        raise TypeError(f"a command forked from the server takes no {sorted(unknown)}: pass fresh=True")
    if fresh or not forkable(module, env):
        counts["fresh"] += 1
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, **kwargs)
    counts["forked"] += 1
    return Forked(_started(), module, args, env=env, **kwargs)


def _started() -> _Server:
    """This test process's server, started now if need be."""
    if not _server:
        _server.append(_Server(dict(_environment)))
        atexit.register(close)
    return _server[0]


def summary() -> str | None:
    """How this test process ran its command lines, for its terminal summary."""
    if not any(counts.values()):
        return None
    return (
        f"command lines: {counts['forked']} forked from the tests' command server, {counts['fresh']} as fresh "
        "interpreters (tests/cli_server.py)"
    )


def forked_cpu() -> float:
    """The CPU time of the commands the server ran so far: not yet in this process's
    RUSAGE_CHILDREN, where they arrive once the server has ended and been waited for."""
    return _server[0].cpu if _server else 0.0


def close() -> None:
    """End this process's server, if it runs (at the session's end, before its CPU time is
    summed, and at this process's exit)."""
    while _server:
        _server.pop().close()


# The server's side.


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork a child for each request as it comes, several running at once; answer each with
    its pid, and each child's end with its exit code and CPU time. Returns (the request, its
    descriptors) in the forked child only. Ends this process when the test process closes its
    end (the children still running go on)."""
    running: dict[int, int] = {}  # a child's pidfd (readable once it has ended) -> its pid
    while True:
        ready, _, _ = select.select([sock.fileno(), *running], [], [])
        for fd in ready:
            if fd != sock.fileno():
                pid = running.pop(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                ended = {"ended": pid, "code": os.waitstatus_to_exitcode(status)}
                sock.send(json.dumps({**ended, "cpu": usage.ru_utime + usage.ru_stime}).encode())
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
            except ConnectionError:
                data, fds = b"", []
            if not data:
                os._exit(0)  # (nothing to tear down; a child still running is left to run)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                sock.close()
                for other in running:
                    os.close(other)
                return request, fds
            for received in fds:
                os.close(received)
            running[os.pidfd_open(pid)] = pid
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _become(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: `python -m MODULE ARGS...` with the request's descriptors,
    working directory and environment, to its end."""
    # (The server's own imports, here and in main: the test process never loads them.)
    import traceback

    from tests.as_main import as_main_module, forget_tests_modules, fresh_process_state, run_as_main

    try:
        if request["session"]:
            os.setsid()  # as `start_new_session=True` does
        fresh_process_state(request["ignored"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        first = _put_first(request["env"].get("PYTHONPATH"), os.environ.get("PYTHONPATH"))  # (the server's)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # (TMPDIR read afresh)
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        sys.path[1:1] = first or []  # what PYTHONPATH puts first (`forkable`): where a fresh interpreter puts it
        sys.argv = [sys.argv[0], *request["args"]]  # (the first becomes the module's file, as `-m` sets it)
        forget_tests_modules()
    except BaseException:
        traceback.print_exc()
        os._exit(70)
    run_as_main(lambda: as_main_module(request["module"]))


def main() -> NoReturn:
    import gc  # (the server's own, as in _become)
    import resource  # (likewise)

    # A Ctrl-C at the terminal, or --processes stopping its processes (SIGINT to their group),
    # reaches the command, which ends as it would; the server waits for it and stays (each
    # child gets Python's own handler back: tests/as_main.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401  (what a command imports first: inherited by every fork)
    import torch._dynamo  # noqa: F401  (every optimizer imports it when it is made)

    import ddpkit.cli  # noqa: F401

    gc.freeze()  # what the children inherit: left out of their collections (and of copies on write)
    own = resource.getrusage(resource.RUSAGE_SELF)
    sock.send(json.dumps({"cpu": own.ru_utime + own.ru_stime}).encode())  # ready: what its imports cost
    request, fds = _serve(sock)
    _become(request, fds)


if __name__ == "__main__":
    main()
