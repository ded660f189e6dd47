"""`ddpkit bench NAME`: one benchmark or all of them, with the options every benchmark takes
and the benchmark's own. The repository's comparison benchmarks (`python -m benchmarks`) use
this same command with their own registry."""

from __future__ import annotations

from collections.abc import Sequence

from .. import checks
from ..device import DEVICES, device_type
from ..errors import UsageError
from .parsing import ArgumentParser


def main(
    argv: Sequence[str], registry: dict[str, str] | None = None, prog: str = "ddpkit bench", table: str = "bench-all"
) -> int:
    from ..bench import BENCHES
    from ..bench.runner import module, run_all, run_one

    registry = BENCHES if registry is None else registry
    if not argv or argv[0] in ("-h", "--help"):
        _usage(registry, prog)
        return 0 if argv else 2
    name = checks.choice("benchmark", argv[0], [*registry, "all"])
    parser = ArgumentParser(prog=f"{prog} {name}")
    parser.add_argument(
        "--json", metavar="FILE", help="where to write the result (default benchmarks/results/NAME-DEVICE.json)"
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="where to draw the plot (default benchmarks/results/NAME-DEVICE.png)"
    )
    parser.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} (default auto)")
    parser.add_argument("--repeats", type=int, default=0, help="timed repetitions (default: the benchmark's own)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes: a smoke run")
    add = getattr(module(name, registry), "add_arguments", None) if name != "all" else None
    if add:
        add(parser)
    a = parser.parse_args(argv[1:])
    checks.at_least("--repeats", a.repeats, 0)
    common = {"device": device_type(a.device), "repeats": a.repeats, "quick": a.quick}
    if name == "all":
        if a.json or a.plot:
            raise UsageError(f"{prog} all writes one file per benchmark under benchmarks/results/; drop --json/--plot")
        return run_all(common, registry, table=table, command=f"{prog} all")
    extra = {k: v for k, v in vars(a).items() if k not in ("json", "plot", "device", "repeats", "quick")}
    run_one(name, dict(common, json_path=a.json, plot_path=a.plot, extra=extra), registry)
    return 0


def _usage(registry: dict[str, str], prog: str) -> None:
    from ..bench.runner import module

    print(
        f"usage: {prog} NAME [--json FILE] [--plot FILE.png] [--device auto|cpu|cuda] [--repeats N] "
        "[--quick] [NAME's options]\n\nbenchmarks:"
    )
    for name in registry:
        try:
            description = module(name, registry).DESCRIPTION
        except ImportError as err:  # an optional dependency missing: say so, list the rest
            description = f"(cannot load: {err})"
        print(f"  {name:<12} {description}")
    print(f"  {'all':<12} every benchmark above, results in benchmarks/results/, then a summary table")
