"""`ddpkit bench NAME`: one benchmark or all of them, with the options every benchmark takes
and the benchmark's own. The repository's comparison benchmarks (`python -m benchmarks`) use
this same command with their own registry."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from ..core import checks
from ..core.device import DEVICES, device_type
from ..errors import UsageError
from .parsing import ArgumentParser

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.


def main(
    argv: Sequence[str], registry: dict[str, str] | None = None, prog: str = "ddpkit bench", table: str = "bench-all"
) -> int:
    from ..observe.timeline import gc_paused

    with gc_paused():  # torch's import makes objects that stay: no collection walks them
        from ..bench import BENCHES
        from ..bench.runner import run_all, run_one

    registry = BENCHES if registry is None else registry
    if not argv or argv[0] in ("-h", "--help"):
        # Asked for, the list is the output; a bare `ddpkit bench` is bad usage: stderr, exit 2.
        _usage(registry, prog, sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = checks.choice("benchmark", argv[0], [*registry, "all"])
    parser = _parser(name, registry, prog)
    a = parser.parse_args(argv[1:])
    _check(parser, a)
    common = {"device": device_type(a.device), "repeats": a.repeats, "quick": a.quick}
    if name == "all":
        if a.json or a.plot:
            raise UsageError(f"{prog} all writes one file per benchmark under benchmarks/results/; drop --json/--plot")
        return run_all(common, registry, table=table, command=f"{prog} all")
    extra = {k: v for k, v in vars(a).items() if k not in ("json", "plot", "device", "repeats", "quick")}
    run_one(name, dict(common, json_path=a.json, plot_path=a.plot, extra=extra), registry)
    return 0


def _parser(name: str, registry: dict[str, str], prog: str = "ddpkit bench") -> ArgumentParser:
    """The options every benchmark takes, and benchmark `name`'s own."""
    from ..bench.runner import module

    parser = ArgumentParser(prog=f"{prog} {name}")
    parser.add_argument(
        "--json", metavar="FILE", help="where to write the result (default benchmarks/results/NAME-DEVICE.json)"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="where to draw the plot (default: beside --json, same name with .png; else benchmarks/results/NAME-DEVICE.png)",
    )
    parser.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} (default auto)")
    parser.add_argument("--repeats", type=int, default=0, help="timed repetitions (default: the benchmark's own)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes: a smoke run")
    add = getattr(module(name, registry), "add_arguments", None) if name != "all" else None
    if add:
        add(parser)
    return parser


def _check(parser: ArgumentParser, a: argparse.Namespace) -> None:
    """What holds for every benchmark's options, checked before any measuring: every integer
    option is a count (a default of 0 means "the benchmark's own", so 0 is allowed there and
    nowhere else), and the output files can be written."""
    for action in parser._actions:
        value = getattr(a, action.dest, None)
        if action.type is int and value is not None:
            flag = action.option_strings[-1]
            if action.default == 0:
                checks.at_least(flag, value, 0)
            else:
                checks.positive(flag, value)
    if a.plot and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {a.plot}: expected a .png file name")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path:
            checks.output_file(flag, path)


def _usage(registry: dict[str, str], prog: str, file: TextIO) -> None:
    from ..bench.runner import module

    print(
        f"usage: {prog} NAME [--json FILE] [--plot FILE.png] [--device auto|cpu|cuda] [--repeats N] "
        "[--quick] [NAME's options]\n\nbenchmarks:",
        file=file,
    )
    for name in registry:
        try:
            description = module(name, registry).DESCRIPTION
        except ImportError as err:  # an optional dependency missing: say so, list the rest
            description = f"(cannot load: {err})"
        print(f"  {name:<12} {description}", file=file)
    print(f"  {'all':<12} every benchmark above, results in benchmarks/results/, then a summary table", file=file)
