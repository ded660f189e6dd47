"""`ddpkit report DIR...`: several runs of `ddpkit train --out DIR` compared."""

from __future__ import annotations

from collections.abc import Sequence

from .parsing import ArgumentParser


def main(argv: Sequence[str]) -> int:
    from ..report import report

    p = ArgumentParser(
        prog="ddpkit report",
        description="Compare runs of `ddpkit train --out DIR`: every run's "
        "loss and accuracy per epoch on one plot, and a table of their results.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="run directories (each with metrics.jsonl and results.json)")
    p.add_argument("--out", default="report.png", metavar="FILE.png", help="the plot (default ./report.png)")
    p.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    a = p.parse_args(argv)
    report(a.dirs, a.out, a.json)
    return 0
