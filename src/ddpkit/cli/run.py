"""`ddpkit run SCRIPT`: a script written for torchrun (or ddpkit.Runtime) on N processes.

Any torchrun command line works with `torchrun` replaced by `ddpkit run`: every option of
torch's own parser (`torch.distributed.run.get_args_parser()`) is accepted, in both its dash and
underscore spellings. An option that means what a ddpkit option means is another spelling of
it (`--nproc-per-node` is `--nproc`); the rendezvous options become `Nodes`; the others are
accepted and ignored where they cannot change what a run computes (EPILOG says what each
does here). What cannot work under ddpkit is refused with one line.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from ..launcher.topology import RDZV_CONF, Nodes
from .parsing import ArgumentParser

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.

DESCRIPTION = """\
Run a script written for torchrun (or ddpkit.Runtime) on N processes per node through torch's
elastic agent. On one machine the rendezvous port is picked by the OS on the loopback address;
on several, every node runs the same command. Any torchrun command line runs with `torchrun`
replaced by `ddpkit run`."""

EPILOG = """\
torchrun's options are all accepted, with dashes or underscores: --nproc-per-node is --nproc,
--rdzv-id is --run-id, and so on. Defaults are ddpkit's: --nproc auto (one per GPU; on CPU one
per 4 cores; torchrun's default is 1 and its auto one per core), --nnodes 1.
Accepted and ignored, as they change nothing a run computes: --run-path (SCRIPT runs by its
path anyway), -r/--redirects and -t/--tee (output is shown as without them; --log-dir keeps
it), --monitor-interval (ddpkit checks every 0.02 s), --start-method (a script is always a new
process), --role, --event-log-handler, --logs-specs, --numa-binding, --signals-to-handle,
--shutdown-timeout, --virtual-local-rank (LOCAL_RANK stays the local rank and every GPU stays
visible), --duplicate-stdout-filters, --duplicate-stderr-filters.
Node ranks come from the c10d rendezvous with either backend, not from --node-rank: see
"Several machines" in docs/launching.md.
"""

C10D_DEFAULT_PORT = 29400  # torch's c10d rendezvous listens there when an endpoint has no port
STD_SPEC = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")  # -r/-t: 3, or LOCAL_RANK:STREAMS,...


def main(argv: Sequence[str]) -> int:
    a = _parser().parse_args(argv)
    nodes, kwargs = settings(a)
    _check_target(a)
    from ..launcher import run_script

    run_script(a.script, a.args, nproc=a.nproc, max_restarts=a.max_restarts, nodes=nodes, **kwargs)
    return 0


def settings(a: argparse.Namespace) -> tuple[Nodes, dict[str, Any]]:
    """The parsed command line as `run_script`'s `nodes` and its output and target options."""
    kwargs = {
        "module": a.module,
        "no_python": a.no_python,
        "log_dir": _log_dir(a.log_dir),
        "show_ranks": _shown_ranks(a.rank0_only, a.local_ranks_filter),
    }
    if a.module and a.no_python:
        raise UsageError("-m runs a Python module; it cannot go with --no-python (SCRIPT is then an executable)")
    if a.shutdown_timeout is not None and a.shutdown_timeout < 0:  # ignored, but checked as torchrun would
        raise UsageError(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    return _nodes(a), kwargs


def _nodes(a: argparse.Namespace) -> Nodes:
    if a.rdzv_backend.lower() not in ("c10d", "static"):
        raise UsageError(
            f"--rdzv-backend {a.rdzv_backend}: ddpkit run uses torch's c10d rendezvous; use c10d or static"
        )
    if a.standalone and a.nnodes not in ("1", "1:1"):
        raise UsageError(f"--standalone runs one node; it cannot go with --nnodes {a.nnodes}")
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint and not a.standalone:  # as torchrun: the endpoint wins; --standalone ignores it
        addr, port = _endpoint(a.rdzv_endpoint)
        if port == 0 and Nodes(a.nnodes).range()[1] > 1:
            raise UsageError(f"--rdzv-endpoint {a.rdzv_endpoint}: the other nodes cannot find port 0; give a port")
    conf = _rdzv_conf(a.rdzv_conf)
    return Nodes(a.nnodes, a.node_rank, addr, port, a.run_id, a.local_addr, conf)


def _endpoint(text: str) -> tuple[str, int]:
    """HOST, HOST:PORT or [IPV6]:PORT, as torchrun's --rdzv-endpoint."""
    host, port = text.strip(), str(C10D_DEFAULT_PORT)
    if host.startswith("[") and "]" in host:
        host, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else port
    elif host.count(":") == 1:
        host, _, port = host.partition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--rdzv-endpoint must be HOST or HOST:PORT with a port up to 65535, got {text!r}")
    return host, int(port)


def _rdzv_conf(text: str) -> dict[str, str]:
    """`--rdzv-conf k=v,k2=v2` as a dict (the values are checked by `Nodes`)."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--rdzv-conf must be KEY=VALUE,..., got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _shown_ranks(rank0_only: bool, ranks_filter: str | None) -> set[int] | None:
    """The local ranks whose output is shown: all (None), --rank0-only's {0}, or the filter's
    ranks (both given: the ranks both show)."""
    shown = {0} if rank0_only else None
    if not ranks_filter:  # torchrun's default, "", filters nothing
        return shown
    parts = ranks_filter.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise UsageError(
            f"--local-ranks-filter must be local ranks separated by commas, such as 0,1; got {ranks_filter!r}"
        )
    ranks = {int(p) for p in parts}
    return ranks if shown is None else ranks & shown


def _log_dir(path: str | None) -> str | None:
    """DIR, if it is a directory or can be made one (nothing is made here: bad input writes nothing)."""
    if path is None:
        return None
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--log-dir {path}: {existing} is not a directory")
    return path


def _check_target(a: argparse.Namespace) -> None:
    """What each worker would run exists: checked here, before any worker starts, so a typo
    is one line and exit code 2 rather than N failed workers."""
    if a.no_python:
        found = shutil.which(a.script) if os.sep not in a.script else a.script
        if not found or not (os.path.isfile(found) and os.access(found, os.X_OK)):
            raise UsageError(f"--no-python {a.script}: no such executable file (nor on PATH)")
    elif a.module:
        _check_module(a.script)
    elif not os.path.isfile(a.script):
        raise UsageError(f"script {a.script}: no such file")


def _check_module(name: str) -> None:
    """`python -m NAME` would find NAME, as the workers search (the working directory first,
    then Python's path): found without running any of its code or its packages'."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise UsageError(f"-m {name}: not a module name")
    found = _module_spec(parts)
    if found is None:
        raise UsageError(f"-m {name}: no such module (searched the working directory and Python's path)")
    locations = found[1]
    if locations is not None and importlib.machinery.PathFinder.find_spec(f"{name}.__main__", locations) is None:
        raise UsageError(f"-m {name}: a package without __main__.py cannot be run")


def _module_spec(parts: list[str]) -> tuple[Any, list[str] | None] | None:
    """(spec, where its submodules are, None for a plain module), or None when not found.

    importlib.util.find_spec('pkg.mod') would import (run) pkg first, so each package is looked
    into through its spec instead; one already imported (or an alias such as os.path) is
    taken as it is, with the __path__ its code may have extended."""
    path: list[str] | None = [os.getcwd()]
    spec = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        if name in sys.modules:
            module = sys.modules[name]
            spec, path = module, getattr(module, "__path__", None)
        elif path is None:  # the previous part is a module, not a package
            return None
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, path) or (_top_level_spec(name) if i == 0 else None)
            if spec is None:
                return None
            path = spec.submodule_search_locations
        path = None if path is None else list(path)
    return spec, path


def _top_level_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)  # for a top-level name this imports nothing
    except (ImportError, ValueError):
        return None


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ddpkit run",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _ddpkit_options(p)
    _torchrun_options(p)
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    return p


def _ddpkit_options(p: ArgumentParser) -> None:
    """ddpkit's options, with torchrun's spellings of the same setting."""
    p.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        default="auto",
        metavar="N",
        help="processes on this node: N, or auto (one per GPU; on CPU one per 4 cores), cpu (one per core) or gpu",
    )
    p.add_argument("--nnodes", default="1", help="number of nodes, N or MIN:MAX (default 1)")
    p.add_argument(
        "--node-rank", "--node_rank", type=int, metavar="R", help="0 on the node that hosts the rendezvous (optional)"
    )
    p.add_argument(
        "--master-addr", "--master_addr", metavar="A", help="address of the rendezvous host (needed when --nnodes > 1)"
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=29500,
        metavar="P",
        help="rendezvous port on that host (default 29500)",
    )
    p.add_argument(
        "--run-id",
        "--rdzv-id",
        "--rdzv_id",
        metavar="ID",
        help="job id, the same on every node (default derived from address and port)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart all workers up to K times when one dies",
    )
    p.add_argument(
        "--rank0-only",
        action="store_true",
        help="show local rank 0's output only; the other ranks' output is discarded, or kept in --log-dir when given",
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m")


def _torchrun_options(p: ArgumentParser) -> None:
    """torchrun's other options (see EPILOG for what each does here); the ones ddpkit ignores
    are still parsed as torchrun parses them, so a bad value is refused as torchrun would."""
    add = _torchrun_option(p)
    add("--rdzv-backend", default="c10d", metavar="B", help="c10d or static: both run torch's c10d rendezvous")
    add("--rdzv-endpoint", metavar="H[:P]", help="--master-addr H --master-port P (P defaults to 29400, as in c10d)")
    add("--rdzv-conf", default="", metavar="K=V,...", help=f"c10d rendezvous settings: {', '.join(RDZV_CONF)}")
    add("--standalone", action="store_true", help="one node, loopback rendezvous (the default on one node)")
    add("--no-python", action="store_true", help="SCRIPT is an executable: run it as it is")
    add("--log-dir", metavar="DIR", help="keep the workers' output and error files in DIR")
    add("--local-ranks-filter", metavar="R,...", help="show these local ranks' output only")
    add("--local-addr", metavar="A", help="this node's address for the others (default: its address on the route)")
    add("--run-path", action="store_true")
    add("--monitor-interval", type=_positive_float)
    add("--start-method", choices=["spawn", "fork", "forkserver"])
    add("--numa-binding", choices=["node", "socket", "exclusive", "core-complex"])
    add("--shutdown-timeout", type=int)
    add("--virtual-local-rank", action="store_true")
    for name in ("--role", "--event-log-handler", "--logs-specs", "--signals-to-handle", "--duplicate-stdout-filters"):
        add(name)
    add("--duplicate-stderr-filters")
    for short, name in (("-r", "--redirects"), ("-t", "--tee")):
        p.add_argument(short, name, type=_std_spec(name), help=argparse.SUPPRESS)


def _torchrun_option(p: ArgumentParser) -> Any:
    """`add(--some-name, ...)`: the option as --some-name and --some_name; hidden from the
    option list when it has no help (EPILOG covers it)."""

    def add(name: str, help: str | None = None, **kwargs: Any) -> None:
        names = dict.fromkeys((name, "--" + name[2:].replace("-", "_")))  # --standalone has one spelling
        p.add_argument(*names, help=help or argparse.SUPPRESS, **kwargs)

    return add


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def _std_spec(name: str) -> Any:
    def check(text: str) -> str:
        if not STD_SPEC.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{name} takes 0..3 or LOCAL_RANK:0..3,..., got {text!r}")
        return text

    return check
