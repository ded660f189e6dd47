"""Run many `ddpkit` command lines in one interpreter: `python -m tests.cli.argv_runner < cases.json`.

Each case is {"argv": [...], "cwd": DIR}: `ddpkit.cli.main(argv)` runs with DIR as the working
directory and file descriptors 1 and 2 sent to files of their own (so C++ warnings and anything
else written to the descriptors is caught too), exactly as `python -m ddpkit ARGV` would exit.
Prints one JSON list of {"code", "stdout", "stderr", "seconds"}: the bad-flag table
(test_bad_flags.py) starts one such process per command instead of one per case, which would
spend most of its time importing torch, and so do the bad-input cases (test_bad_input.py).
Each case starts from the environment variables the interpreter started with.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import IO, Any


def run_case(argv: list[str], cwd: str) -> dict[str, Any]:
    from ddpkit.cli import main

    start, environ = time.perf_counter(), dict(os.environ)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _redirected(out, err, cwd):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse, or anything else leaving as `python -m ddpkit` would
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # what `python -m ddpkit` would print on the way out
                traceback.print_exc()
                code = 1
        os.environ.clear()
        os.environ.update(environ)  # nothing one case set reaches the next
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"code": code, "stdout": texts[0], "stderr": texts[1], "seconds": time.perf_counter() - start}


@contextlib.contextmanager
def _redirected(out: IO[bytes], err: IO[bytes], cwd: str) -> Iterator[None]:
    """File descriptors 1 and 2 into `out` and `err`, and `cwd` the working directory."""
    saved_out, saved_err, saved_cwd = os.dup(1), os.dup(2), os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    os.chdir(cwd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(saved_cwd)
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)


def run_batch(cases: list[dict], path: str = "") -> list[dict]:
    """Run `cases` ({"argv", "cwd"} each) in one interpreter of this module, with `path` (if
    any) and the repository on its PYTHONPATH, from the test process; their outcomes in order."""
    from tests.conftest import run_helper  # (the test process's: not loaded where the runner runs)

    return run_helper("tests.cli.argv_runner", cases, 600, path)


def main() -> None:
    cases = json.load(sys.stdin)
    results = [run_case(c["argv"], c["cwd"]) for c in cases]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
