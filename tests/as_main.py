"""Run a program in a forked process as `python FILE` or `python -m MODULE` would, and end that
process as the interpreter would. Shared by the suite's forking runners (tests/cli_server.py,
tests/docs/program_runner.py), whose children were forked from an interpreter that had already
imported torch, so that each starts in a fraction of a second instead of some 2 s of imports."""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import NoReturn

from ddpkit.cli import end_program

# What a program may find ignored where it is started from (`fresh_process_state`)
SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forget_tests_modules() -> None:
    """Drop the runner's own modules (`tests.*`): the program imports them afresh if it does."""
    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]


def fresh_process_state(ignored: list[int]) -> None:
    """What an interpreter starts with and a forked one inherits otherwise: the signals ignored
    where the program was started from (`ignored`) ignored, the others at their defaults
    (SIGINT Python's KeyboardInterrupt), and NumPy's global generator seeded afresh as a new
    process seeds it (Python's `random` reseeds itself in a forked child)."""
    for sig in SIGNALS:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def ignored_signals() -> list[int]:
    """The signals this process ignores, of SIGNALS."""
    return [int(s) for s in SIGNALS if signal.getsignal(s) is signal.SIG_IGN]


def as_main_module(module: str) -> None:
    """`python -m MODULE`: the module run in a new `__main__` that stays `__main__` to the end
    (runpy.run_module would put the runner's back when it returns, before the program's threads
    and atexit handlers are done)."""
    sys.modules["__main__"] = types.ModuleType("__main__")
    runpy._run_module_as_main(module, alter_argv=True)  # what `python -m` itself calls


def as_main_file(path: str) -> None:
    """`python PATH`: the file's code run in a new `__main__` that stays `__main__` to the end."""
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


def run_as_main(run: Callable[[], object]) -> NoReturn:
    """Call `run` (the program as `__main__`) and end this process as the interpreter ends one:
    SystemExit read as it reads it (None 0, a number itself, anything else printed and 1), an
    uncaught exception given to `sys.excepthook` and 1, an uncaught KeyboardInterrupt printed
    and the process killed by SIGINT; then what `threading` does at the end (its atexit hooks,
    such as an idle thread pool's wake-up, and the non-daemon threads joined), the atexit
    handlers run and the output flushed."""
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
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what the interpreter calls first at its end
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
