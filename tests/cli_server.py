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
own variables, PYTHONPATH...) runs as a fresh interpreter instead (`forkable`): only what is read
as a command runs may differ (RUNTIME_VARIABLES, RUNTIME_PREFIXES). So does every command line
when TESTS_CLI_EXEC=1 is set, to run the suite the old way, and one that asks (`fresh`: the
session's shared run, as a user starts it). The tests of what starting a command costs or loads
(`--help` without torch, the progress bar on a terminal) and those that signal a running command
start their own interpreters, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from tests.as_main import ignored_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
MODULES = ("ddpkit", "benchmarks")  # what the server runs as `python -m`
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
_MESSAGE = 1 << 20  # the largest request or reply, in bytes


class _Server:
    """The test process's server: its process and its end of the socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
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
        data = self.sock.recv(_MESSAGE)
        if not data:
            self.log.seek(0)
            raise RuntimeError(f"the tests' command server ended: {self.log.read().decode(errors='replace')[-3000:]}")
        return json.loads(data)

    def run(
        self, module: str, args: Sequence[str], env: dict[str, str], cwd: str | None, stdin: str | None, timeout: float
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, *args]
        request = {
            "module": module,
            "args": list(args),
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "ignored": ignored_signals(),  # (a fresh interpreter inherits what this process ignores)
        }
        with tempfile.TemporaryFile() as source, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            if stdin is not None:
                source.write(stdin.encode(locale.getpreferredencoding(False)))  # as text=True encodes it
                source.seek(0)
            fds = [0 if stdin is None else source.fileno(), out.fileno(), err.fileno()]  # None: this process's own
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            pid = self.reply(None)["pid"]
            try:
                end = self.reply(timeout)
            except BaseException as exc:  # past its timeout, interrupted, failed: killed, as subprocess does
                with contextlib.suppress(ProcessLookupError):  # (unless it has just ended)
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(OSError, RuntimeError):  # (a server gone: this exception stands)
                    self.cpu += self.reply(60)["cpu"]
                if isinstance(exc, TimeoutError):  # with what it wrote, as bytes (None: nothing), as subprocess does
                    raise subprocess.TimeoutExpired(cmd, timeout, _raw(out), _raw(err)) from None
                raise
            self.cpu += end["cpu"]
            return subprocess.CompletedProcess(cmd, end["code"], _text(out), _text(err))

    def close(self) -> None:
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
    return all(k in RUNTIME_VARIABLES or k.startswith(RUNTIME_PREFIXES) for k in differ)


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
    if not _server:
        _server.append(_Server(dict(_environment)))
        atexit.register(close)
    try:
        return _server[0].run(module, args, env, cwd, stdin, timeout)
    except BaseException as exc:
        if not isinstance(exc, subprocess.TimeoutExpired):  # (its state unknown: a new server next time)
            close()
        raise


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
    """Run the requests, one at a time; returns (the request, its descriptors) in the forked
    child only. Ends this process when the test process closes its end."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
        except ConnectionError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # (nothing to tear down: its children were all waited for)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status, usage = os.wait4(pid, 0)
        sock.send(
            json.dumps({"code": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}).encode()
        )


def _become(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: `python -m MODULE ARGS...` with the request's descriptors,
    working directory and environment, to its end."""
    # (The server's own imports, here and in main: the test process never loads them.)
    import traceback

    from tests.as_main import as_main_module, forget_tests_modules, fresh_process_state, run_as_main

    try:
        fresh_process_state(request["ignored"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # (TMPDIR read afresh)
        sys.path[0] = os.getcwd()  # as `python -m` puts it
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
