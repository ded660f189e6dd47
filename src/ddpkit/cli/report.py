"""`ddpkit report DIR...`: several runs of `ddpkit train --out DIR` compared."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..core import checks
from ..errors import UsageError
from .parsing import ArgumentParser

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.

DEFAULT_OUT = "report.png"


def main(argv: Sequence[str]) -> int:
    from ..observe.report import load_run, report, wrote

    a = _parser().parse_args(argv)
    runs = [load_run(path) for path in a.dirs]  # the runs first: a missing one before a plot in the way
    out = a.out or DEFAULT_OUT
    if a.out is None and os.path.lexists(out) and not wrote(out):
        # The default name is a convenience, not a request to replace a file that is there: a
        # report.png that ddpkit report drew (its PNG says so) is replaced, anyone else's stays
        # unless --out names it.
        raise UsageError(
            f"./{out} exists and was not drawn by ddpkit report; name the plot with --out FILE.png "
            "(an --out that exists is replaced)"
        )
    for flag, path in (("--out", out), ("--json", a.json)):
        if path:  # checked before reading the runs and drawing: not an IsADirectoryError after the work
            checks.output_file(flag, path)
    report(a.dirs, out, a.json, runs)
    return 0


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ddpkit report",
        description="Compare runs of `ddpkit train --out DIR`: every run's loss and accuracy per epoch on one "
        "plot, and a table of their results. A Runtime's log_dir among them: every run's rt.log metrics against "
        "the step, and a table of their last values.",
    )
    p.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="run directories: a ddpkit train --out (metrics.jsonl and results.json) or a Runtime's log_dir "
        "(metrics.jsonl)",
    )
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help=f"the plot (default ./{DEFAULT_OUT}, replaced only if ddpkit report drew it: to replace another file, name it)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the table as JSON (replaced if it exists)")
    return p
