"""The `ddpkit` command: one module per command, each parsing its arguments and calling one
function; this module maps what they raise to exit codes.

Exit codes: 0 success; 2 bad usage or input (one line on stderr naming the flag or file, no
traceback); 1 a failure during the run (the failing rank, its host and its error); 130 on
Ctrl-C, 143 on SIGTERM; 141 when the reader of stdout went away.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..core import checks
from ..core.signals import set_handler
from ..errors import Interrupted, RunError, UsageError, WorkerFailed, interrupt_behind
from ..version import __version__

# Imports inside functions: `ddpkit --help` and a bad flag's one line load no torch; a
# command's modules load when it runs.

USAGE = f"""ddpkit {__version__}: PyTorch training on 1 CPU, 1 GPU, all GPUs or many machines.

usage: ddpkit <command> [options]     (ddpkit <command> --help for its options)

commands:
  train    train a built-in model on a built-in dataset over all local devices
  run      run your own script (written for torchrun or ddpkit.Runtime) on N processes
  env      what this machine offers: PyTorch build, GPUs, backends, ddpkit's defaults
  bench    measure ddpkit's parts: loaders, workers, precision, comm, scaling, models
  find-batch-size  the largest per-device batch that fits, and the throughput at each size
  report   compare runs (train --out DIRs): their curves on one plot and a table of results
  plan     will a job fit on N GPUs, and how fast: every layout's memory and step time, predicted
"""

# command -> the module whose main(argv) runs it (imported on use: `ddpkit --help` stays fast)
COMMANDS: dict[str, str] = {
    "train": "train",
    "run": "run",
    "env": "env",
    "bench": "bench",
    "find-batch-size": "find_batch_size",
    "report": "report",
    "plan": "plan",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (None: this program's, `sys.argv`); its exit code."""
    if argv is not None:
        return _main(list(argv))
    code = _main(sys.argv[1:])
    # (Not for callers passing `argv`: their process goes on.)
    end_program(code)
    return code  # where end_program left the ending to the interpreter


def end_program(code: int) -> None:
    """End this program with `code` as the interpreter would, without its teardown.

    After `import torch` the teardown frees every object one by one (some 300 000, which a
    last garbage collection would walk too) and runs the C++ destructors of torch's
    libraries: about 0.1 s of a small job's command, for memory the OS takes back at once.
    What the teardown does that matters is done first, in its order: the atexit handlers
    (logging's flush, temporary directories' cleanup, multiprocessing's children, the
    trackers' own), then Python's and C's buffered output. Output that cannot be written
    then is exit code 141 (the reader went away) or 120 (as the interpreter's), where `code`
    said success. When a non-daemon thread is still running (the interpreter would wait for
    it) the interpreter ends the program as usual, with the objects frozen so that its last
    collection skips them.
    """
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        gc.freeze()
        return
    atexit._run_exitfuncs()
    streams = {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    for stream in streams.values():
        try:
            stream.flush()
        except BrokenPipeError:  # the reader of stdout went away at the very end
            code = code or 141
        except OSError as err:  # output lost (a full disk): not a success, as the interpreter says
            code = code or 120
            with contextlib.suppress(OSError, ValueError):
                os.write(2, f"ddpkit: could not write the last of its output: {err}\n".encode())
        except (ValueError, AttributeError):  # closed, or replaced by something odd
            pass
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C's stdio buffers (torch's C++ prints), as exit() would
    os._exit(code)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        # Asked for, the usage is the output; a bare `ddpkit` is bad usage: stderr, exit 2.
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"ddpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ddpkit: error: {checks.choice_message('command', name, COMMANDS)}", file=sys.stderr)
        return 2
    if name in ("train", "run", "find-batch-size", "bench"):
        try:  # before torch is imported: OpenMP would first complain on its own, in a line of its own
            checks.thread_count_variable()
        except UsageError as err:
            print(f"ddpkit {name}: error: {one_line(str(err))}", file=sys.stderr)
            return 2
    command = importlib.import_module(f"{__name__}.{COMMANDS[name]}")
    return run_command(f"ddpkit {name}", command.main, rest)


def run_command(prog: str, fn: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """`fn(argv)`'s exit code, with every exception mapped to its exit code and message."""
    try:
        with _sigterm_interrupts():
            return fn(argv)
    except UsageError as err:
        print(f"{prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except WorkerFailed as err:
        if err.traceback:
            print(err.traceback.rstrip(), file=sys.stderr)
        return _interrupted_all_the_same(prog, err, str(err)) or _said(f"{prog}: {err}", 1)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (see `_sigterm_interrupts`)
        signum = getattr(err, "signum", signal.SIGINT)
        note = getattr(err, "note", "")
        print(f"{prog}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `ddpkit env --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except RunError as err:  # a failure its message explains whole (a full disk): no traceback
        from ..core.dist import detect_env

        line = f"{prog}: rank {detect_env().rank} on {socket.gethostname()} failed: {err}"
        return _interrupted_all_the_same(prog, err, str(err)) or _said(line, 1)
    except Exception as err:  # a failure in this process (one process, or a torchrun/srun worker)
        from ..core.dist import detect_env

        traceback.print_exc()
        what = f"{type(err).__name__}: {err}"
        line = f"{prog}: rank {detect_env().rank} on {socket.gethostname()} failed: {what}"
        return _interrupted_all_the_same(prog, err, what) or _said(line, 1)


def _said(line: str, code: int) -> int:
    print(line, file=sys.stderr)
    return code


def _interrupted_all_the_same(prog: str, err: BaseException, what: str) -> int | None:
    """Where `err` was raised while a Ctrl-C (or SIGTERM) unwound, by a cleanup it cut short:
    one line that says so, and the signal's exit code (the interrupt is the cause); else None."""
    interrupt = interrupt_behind(err)
    if interrupt is None:
        return None
    signum = getattr(interrupt, "signum", signal.SIGINT)
    return _said(f"{prog}: interrupted; the cleanup after it failed: {what}", 128 + signum)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's stop, `kill`) and SIGHUP end a command as Ctrl-C does: the work
    unwinds (checkpoints are written whole or not at all) and one line says so, exit code 143
    (129)."""
    if threading.current_thread() is not threading.main_thread() or _a_launchers_worker():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    # SIGHUP too (the terminal closed), unless it is ignored (nohup): a run of several processes
    # ends on it with its line through the launcher's agent, and one in this process alike.
    hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL else []
    previous = {sig: set_handler(sig, interrupt) for sig in (signal.SIGTERM, *hangup)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            set_handler(sig, handler)


def _a_launchers_worker() -> bool:
    """Started by torchrun or srun as one of several: their agent stops it with SIGTERM, which
    must end it at once, even inside a collective (a Python handler would wait for the call)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def one_line(message: str) -> str:
    """A message on one line: a user's model or torch may raise errors of several lines."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())
