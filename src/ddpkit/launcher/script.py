"""What each worker of `ddpkit run` runs: `python -u -m ddpkit.launcher.script [-m] TARGET ARGS...`.

It runs the user's script (or module) as `python SCRIPT` would, as `__main__` with `sys.argv`
set, after three things a bare `python SCRIPT` cannot do:

- record the worker and arm its stack dump (see `records`), so a hung or killed rank is named;
- after a restart, rank 0 says why the previous attempt ended;
- an exception the script does not catch is written to the agent's error file (what torch's
  `@record` does for a script that uses it), so the launcher reports the failing rank's own
  traceback, and is printed once, without the `[rankN]:` prefix torch's excepthook would add
  on top of the launcher's.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from types import TracebackType

from . import records
from .failures import restart_note


def main(argv: list[str]) -> int:
    module = argv[:1] == ["-m"]
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    records.arm()
    if os.environ.get("RANK") == "0" and (note := restart_note()):
        print(f"ddpkit run: {note}", file=sys.stderr, flush=True)
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # the script's folder, not the cwd
            runpy.run_path(target, run_name="__main__")
    except SystemExit as err:
        code = _exit_code(err.code)
    except KeyboardInterrupt:  # Ctrl-C, passed on by the agent: the launcher says it once
        return 128 + signal.SIGINT
    except BaseException as err:  # noqa: BLE001 - reported, then the worker fails
        err.__traceback__ = _user_frames(err.__traceback__)
        _record(err)
        traceback.print_exception(err, file=sys.stderr)
        return 1
    else:
        code = 0
    if code == 0:
        records.mark_done()
    return code


def _exit_code(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's code on: without this module's and runpy's frames."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in ours or os.path.abspath(tb.tb_frame.f_code.co_filename) in ours
    ):
        tb = tb.tb_next
    return tb


ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where the agent reads a failed worker's error


def _record(err: BaseException) -> None:
    """`err` into the agent's error file, whole or not at all: torch writes it in place, and the
    agent's SIGTERM (a peer failed first) could stop the write half-way, leaving a file the
    agent then failed to parse (JSONDecodeError: the launcher itself crashed). Written beside
    it, then renamed over it."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler  # only once the script failed

    handler = get_error_handler()
    handler.initialize()
    final = os.environ.get(ERROR_FILE)
    if not final:
        handler.record_exception(err)  # (no file: torch logs it)
        return
    partial = f"{final}.partial"
    os.environ[ERROR_FILE] = partial
    try:
        handler.record_exception(err)
        os.replace(partial, final)
    finally:
        os.environ[ERROR_FILE] = final


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
