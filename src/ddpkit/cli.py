"""The `ddpkit` command: parse into a typed config, call one function, map errors to exit codes.

Exit codes: 0 success; 2 bad usage or input (one line on stderr naming the flag or file, no
traceback); 1 a failure during the run (the failing rank, its host and its error).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
import typing
from typing import Any, Callable, NoReturn, Sequence

from . import __version__
from .errors import UsageError, WorkerFailed

USAGE = f"""ddpkit {__version__}: PyTorch training on 1 CPU, 1 GPU, all GPUs or many machines.

usage: ddpkit <command> [options]     (ddpkit <command> --help for its options)

commands:
  train    train a built-in model on a built-in dataset over all local devices
  run      run your own script (written for torchrun or ddpkit.Runtime) on N processes
  env      what this machine offers: PyTorch build, GPUs, backends, ddpkit's defaults
  bench    measure: parity with hand-written DDP, loaders, precision, comm, scaling, start-up
  find-batch-size  the largest per-device batch that fits, and the throughput at each size
  report   compare runs (train --out DIRs): their curves on one plot and a table of results
"""


class _OneLineParser:
    """Mixin: argparse errors become one line and exit code 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


class _ArgParser(_OneLineParser, argparse.ArgumentParser):
    pass


def _train_parser(defaults: Any) -> Any:
    import simple_parsing

    class Parser(_OneLineParser, simple_parsing.ArgumentParser):
        pass

    from .config import TrainConfig

    parser = Parser(prog="ddpkit train", description=TrainConfig.__doc__,
                    add_option_string_dash_variants=simple_parsing.DashVariant.DASH)
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file of options (keys as the flags without '--'); flags on the command line override it")
    parser.add_arguments(TrainConfig, dest="cfg", default=defaults)
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    """Options from a YAML file, keys with '-' or '_', values checked against TrainConfig's types."""
    import yaml

    from .config import FIELDS, TrainConfig

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise UsageError(f"--config {path}: not valid YAML{at}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(raw).__name__}")
    types = typing.get_type_hints(TrainConfig)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise UsageError(f"--config {path}: unknown option {key!r}")
        values[name] = _coerce(path, key, value, types[name])
    return values


def _coerce(path: str, key: str, value: Any, kind: Any) -> Any:
    allowed = typing.get_args(kind) or (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    wanted = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise UsageError(f"--config {path}: {key} should be {wanted}, got {value!r}")


def cmd_train(argv: Sequence[str]) -> int:
    from .config import TrainConfig

    from .config import recipe
    from .runtime import resolve_device

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--model")
    pre.add_argument("--device")
    known, _ = pre.parse_known_args(argv)
    from_file = load_config_file(known.config) if known.config else {}
    # Precedence, lowest first: built-in defaults, the model's recipe, the YAML file, flags.
    model = known.model or from_file.get("model", TrainConfig.model)
    device = known.device or from_file.get("device", TrainConfig.device)
    device_type = resolve_device(device, bind=False).type if device in ("auto", "cpu", "cuda") else "cpu"
    defaults = TrainConfig(**{**recipe(model, device_type), **from_file})
    cfg = _train_parser(defaults).parse_args(argv).cfg
    from .trainer import train

    train(cfg)
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    parser = _ArgParser(prog="ddpkit run", description="Run a script written for torchrun (or ddpkit.Runtime) on N "
                        "processes per node through torch's elastic agent. On one machine the rendezvous port is "
                        "picked by the OS on the loopback address; on several, every node runs the same command.")
    parser.add_argument("--nproc", default="auto", help="processes on this node: N, or auto (one per GPU; on CPU one per 4 cores)")
    parser.add_argument("--nnodes", default="1", help="number of nodes, N or MIN:MAX (default 1)")
    parser.add_argument("--node-rank", type=int, help="0 on the node that hosts the rendezvous (optional)")
    parser.add_argument("--master-addr", help="address of the rendezvous host (needed when --nnodes > 1)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port on that host (default 29500)")
    parser.add_argument("--run-id", help="job id, the same on every node (default derived from address and port)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to N times when one dies")
    parser.add_argument("--rank0-only", action="store_true", help="show local rank 0's output only (others: logs)")
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    a = parser.parse_args(argv)
    if not a.module and not os.path.isfile(a.script):
        raise UsageError(f"script {a.script}: no such file")
    if a.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {a.max_restarts}")
    from .launcher import Nodes, run_script

    nodes = Nodes(a.nnodes, a.node_rank, a.master_addr, a.master_port, a.run_id)
    run_script(a.script, a.args, nproc=a.nproc, max_restarts=a.max_restarts, nodes=nodes,
               output="rank0" if a.rank0_only else "prefixed", module=a.module)
    return 0


def cmd_env(argv: Sequence[str]) -> int:
    parser = _ArgParser(prog="ddpkit env", description="Report PyTorch build, GPUs, backends and ddpkit's defaults.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    from .env import render, report

    r = report()
    print(json.dumps(r, indent=2) if args.json else render(r))
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from .bench import BENCHES

    names = [*BENCHES, "all"]
    if not argv or argv[0] in ("-h", "--help"):
        from .bench import module

        print("usage: ddpkit bench NAME [--json FILE] [--plot FILE.png] [--device auto|cpu|cuda] [--repeats N] "
              "[--quick] [NAME's options]\n\nbenchmarks:")
        for name in BENCHES:
            try:
                description = module(name).DESCRIPTION
            except ImportError as err:  # an optional dependency missing: say so, list the rest
                description = f"(cannot load: {err})"
            print(f"  {name:<12} {description}")
        print(f"  {'all':<12} every benchmark above, results in benchmarks/results/, then a summary table")
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        raise UsageError(f"unknown benchmark {name!r}; choose from {', '.join(names)}")
    parser = _ArgParser(prog=f"ddpkit bench {name}")
    parser.add_argument("--json", metavar="FILE", help="where to write the result (default benchmarks/results/NAME-DEVICE.json)")
    parser.add_argument("--plot", metavar="FILE.png", help="where to draw the plot (default benchmarks/results/NAME-DEVICE.png)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=0, help="timed repetitions (default: the benchmark's own)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sizes: a smoke run")
    if name != "all":
        from .bench import module

        add = getattr(module(name), "add_arguments", None)
        if add:
            add(parser)
    a = parser.parse_args(argv[1:])
    if a.repeats < 0:
        raise UsageError(f"--repeats must be >= 0, got {a.repeats}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is visible")
    from .bench.all import run_all, run_one

    common = {"device": a.device, "repeats": a.repeats, "quick": a.quick}
    if name == "all":
        if a.json or a.plot:
            raise UsageError("bench all writes one file per benchmark under benchmarks/results/; drop --json/--plot")
        return run_all(common)
    extra = {k: v for k, v in vars(a).items() if k not in ("json", "plot", "device", "repeats", "quick")}
    run_one(name, dict(common, json_path=a.json, plot_path=a.plot, extra=extra))
    return 0


def cmd_find_batch_size(argv: Sequence[str]) -> int:
    from .tune import cli_main

    return cli_main(argv, _ArgParser)


def cmd_report(argv: Sequence[str]) -> int:
    from .report import cli_main

    return cli_main(argv, _ArgParser)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"train": cmd_train, "run": cmd_run, "env": cmd_env,
                                                       "bench": cmd_bench, "find-batch-size": cmd_find_batch_size,
                                                       "report": cmd_report}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"ddpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ddpkit: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name](rest)
    except UsageError as err:
        print(f"ddpkit {name}: error: {err}", file=sys.stderr)
        return 2
    except WorkerFailed as err:
        if err.traceback:
            print(err.traceback.rstrip(), file=sys.stderr)
        print(f"ddpkit {name}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ddpkit {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ddpkit env --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # a failure in this process (one process, or a torchrun/srun worker)
        from .dist import detect_env

        traceback.print_exc()
        rank = detect_env().rank
        print(f"ddpkit {name}: rank {rank} on {socket.gethostname()} failed: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 1
