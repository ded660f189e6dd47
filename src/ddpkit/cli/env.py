"""`ddpkit env`: what this machine offers for training, as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .parsing import ArgumentParser

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    from ..observe.timeline import gc_paused

    with gc_paused():  # torch's import makes objects that stay: no collection walks them
        from ..observe.env import render, report

    r = report()
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="ddpkit env", description="Report PyTorch build, GPUs, backends and ddpkit's defaults."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser
