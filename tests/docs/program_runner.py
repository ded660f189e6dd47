"""Run the documentation's programs, each in a process of its own forked from one interpreter:
`python -m tests.docs.program_runner < programs.json`.

Each program is {"path": FILE, "cwd": DIR}: the runner forks, and the child runs FILE as
`python FILE` would (as `__main__`, `sys.argv` its path, DIR the working directory,
file descriptors 1 and 2 sent to files of their own) and ends as the interpreter would: its
threads joined, its atexit handlers run, its output flushed. Prints one JSON list of {"code",
"stdout", "stderr", "seconds"}; a program still running after "timeout" seconds is killed
(code "timeout").

What differs from a fresh interpreter is what the runner imported before forking: torch, its
compiler and ddpkit, which every program imports first anyway (ddpkit's own forked workers
start the same way). A fresh interpreter per program spent about 2.4 s of CPU on those
imports, most of a documentation program's cost (tests/docs/test_programs.py). The runner
never runs a torch operation itself, so no child inherits a thread pool of OpenMP's.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

from tests.as_main import as_main_file, forget_tests_modules, fresh_process_state, ignored_signals, run_as_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def run_program(path: str, cwd: str, timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the program's process, in a process group of its own (a timeout stops all of it)
            try:
                fresh_process_state(ignored_signals())  # (the runner's own: a fresh interpreter's)
                os.setpgid(0, 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.chdir(cwd)
                _run_as_main(path)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(70)  # (only if ending it failed)
        code = _wait(pid, timeout)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"code": code, "stdout": texts[0], "stderr": texts[1], "seconds": time.perf_counter() - start}


def _run_as_main(path: str) -> None:
    """`python PATH`, in this (forked) process, to its end: never returns."""
    sys.argv = [path]
    forget_tests_modules()
    # the program's folder first on the path, as `python FILE` puts it, and not the repository's
    sys.path[:] = [os.path.dirname(os.path.abspath(path))] + [
        p for p in sys.path[1:] if os.path.abspath(p or ".") != ROOT
    ]
    run_as_main(lambda: as_main_file(path))


def _wait(pid: int, timeout: float) -> int | str:
    """The exit code of child `pid` (as subprocess gives it: minus the signal that killed
    it), or "timeout" after killing it."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)  # the program and what it started
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def run_all(programs: list[dict], timeout: float = 240) -> list[dict]:
    """Run `programs` ({"path", "cwd"} each) in one runner process started from the test
    process, with the repository on its PYTHONPATH; their outcomes in order."""
    from tests.conftest import run_helper  # (the test process's: not loaded where the runner runs)

    return run_helper(
        "tests.docs.program_runner", [{**p, "timeout": timeout} for p in programs], timeout * len(programs) + 60
    )


def main() -> None:
    cases = json.load(sys.stdin)
    import torch  # noqa: F401  (what each program imports first: inherited by every fork)
    import torch._dynamo  # noqa: F401  (every optimizer imports it when it is made)

    gc.freeze()  # what the children inherit: left out of their collections (and of copies on write)

    results = [run_program(c["path"], c["cwd"], c["timeout"]) for c in cases]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
