"""Starting workers through torch's elastic launcher.

ddpkit manages no processes itself: `torch.distributed.launcher.api.elastic_launch` starts the
workers, runs the rendezvous, watches them, and stops the others when one fails. This module
adds what the tutorials get wrong by hand:

- no fixed MASTER_PORT: on one machine the rendezvous binds port 0 on the loopback address and
  the OS picks (see `Nodes.rendezvous`);
- each process gets its share of the cores (OMP_NUM_THREADS), not all of them;
- a failure becomes one `WorkerFailed` naming the rank that caused it (see `failures`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from .. import device as devices
from ..device import threads_per_process
from .failures import as_worker_failed
from .topology import Nodes, Topology, local
from .workers import choose_start_method, entrypoint, gc_frozen, main_hidden


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int | str = "auto",
    device: str = "auto",
    max_restarts: int = 0,
    nodes: Nodes = Nodes(),
    **kwargs: Any,
) -> dict[int, Any]:
    """Run `fn(*args, **kwargs)` in `nproc` worker processes per node; return {rank: return
    value} for this node's ranks, in rank order.

    Works for functions defined in scripts, modules, notebooks and programs read from stdin.
    Raises `WorkerFailed` naming the first failing rank; the other workers are stopped by the
    elastic agent. `device` ('auto', 'cpu' or 'cuda') decides `nproc='auto'` (one process per
    visible GPU, or on CPU one per 4 cores) and how workers start: when it resolves to 'cpu'
    they are forked from this process (fast), so they must not use CUDA; with 'cuda' they are
    spawned afresh. Set DDPKIT_START_METHOD=spawn to always spawn.
    """
    topo = local(devices.device_type(device, what="device"), nproc, nodes, max_restarts)
    return run_function(topo, fn, *args, **kwargs)


def run_function(topo: Topology, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, Any]:
    """`fn(*args, **kwargs)` on the workers of a resolved `Topology`; {rank: return value}."""
    payload = cloudpickle.dumps((fn, args, kwargs))
    method = choose_start_method(topo.device_type)
    results = _elastic(topo, entrypoint, (payload, method == "fork"), output="inherit", start_method=method)
    return dict(sorted(results.items()))  # the agent lists them in the order workers finished


def run_script(
    script: str,
    args: list[str],
    *,
    nproc: int | str = "auto",
    max_restarts: int = 0,
    nodes: Nodes = Nodes(),
    output: str = "prefixed",
    module: bool = False,
) -> None:
    """Run a script written for torchrun (or for ddpkit's Runtime) on `nproc` processes per
    node: `python -u SCRIPT ARGS...` (or `-m MODULE`) with RANK, WORLD_SIZE, MASTER_ADDR, ...
    set. `output` is 'prefixed' ("[rank3]: ..." per line) or 'rank0' (other local ranks'
    output goes to the log directory only)."""
    topo = local(devices.device_type("auto"), nproc, nodes, max_restarts)
    target = ["-m", script] if module else [script]
    _elastic(topo, sys.executable, ("-u", *target, *args), output=output)


def _elastic(topo: Topology, entrypoint: Any, args: tuple, output: str, start_method: str = "spawn") -> Any:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n, (low, high) = topo.nproc, topo.nodes.range()
    logs = tempfile.mkdtemp(prefix="ddpkit-launch-")
    streams: dict[str, Any] = {}
    if output == "prefixed":
        streams = {"tee": Std.ALL}
    elif output == "rank0":
        streams = {"redirects": {r: Std.ALL for r in range(1, n)}, "tee": {0: Std.ALL}}
    config = LaunchConfig(
        # Our own directory for the workers' error files: the agent reports only the first
        # failure it notices, which may be a rank that died *because* another one did.
        logs_specs=DefaultLogsSpecs(log_dir=logs, **streams),
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=n,
        rdzv_backend="c10d",
        max_restarts=topo.max_restarts,
        monitor_interval=0.1,
        start_method=start_method,  # workers given as a function; a script is always a new process
        log_line_prefix_template="[rank${rank}]: " if output != "inherit" else None,
        **topo.rendezvous,
    )
    try:
        # Each process gets its share of the cores instead of all of them (oversubscription
        # makes CPU DDP several times slower). A value the user set is kept.
        # A store shared between rendezvous and workers keeps the previous attempt's keys, so
        # restarted workers can read stale peer addresses (pytorch/pytorch#135712): let each
        # attempt's workers have a store of their own.
        with (
            _env("OMP_NUM_THREADS", str(threads_per_process(n))),
            _env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
            _quiet_elastic_logs(),
            main_hidden() if start_method == "spawn" else gc_frozen(),
        ):
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        raise as_worker_failed(err, logs) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """Silence the agent for the duration of a launch, then restore the caller's levels.

    The agent logs its every step, and a worker's traceback once per layer. WorkerFailed
    carries the failing rank's traceback instead, printed once by whoever catches it.
    torch gives each module its own logger with its own level, so the parent's is not enough.
    """
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the workers unless the user set it; restore afterwards."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
