"""End a forked process as `python FILE` or `python -m MODULE` would: the code run as `__main__`,
then the interpreter's own ending. Shared by the suite's forking runners (tests/cli_server.py,
tests/docs/program_runner.py), whose children were forked from an interpreter that had already
imported torch, so that each starts in a fraction of a second instead of some 2 s of imports."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from ddpkit.cli import end_program


def forget_tests_modules() -> None:
    """Drop the runner's own modules (`tests.*`): the program imports them afresh if it does."""
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]


def run_as_main(run: Callable[[], object]) -> NoReturn:
    """Call `run` (the program as `__main__`) and end this process as the interpreter ends one:
    SystemExit read as it reads it (None 0, a number itself, anything else printed and 1), an
    uncaught exception printed and 1, an uncaught KeyboardInterrupt printed and the process
    killed by SIGINT; then its non-daemon threads joined, its atexit handlers run and its output
    flushed."""
    code = 0
    interrupted = False
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    while waited := [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]:
        for thread in waited:  # the interpreter waits for them (and the threads they start) before its end
            thread.join()
    if not interrupted:
        end_program(code)  # atexit handlers, buffered output, then os._exit
        os._exit(code)  # (end_program returns only while a thread runs: none does now)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as CPython ends on an uncaught KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # (only if the signal did not end it)
