"""Start N local workers through torch's elastic launcher, and report the first failure by rank.

ddpkit manages no processes itself: `torch.distributed.launcher.api.elastic_launch` starts the
workers, runs the rendezvous, watches them, and stops the others when one fails. This module
adds what the tutorials get wrong by hand:

- no fixed MASTER_PORT: the rendezvous binds port 0 on the loopback address and the OS picks;
- functions from a notebook or from `python -` on stdin work: the function is pickled by value
  (cloudpickle), so the `spawn`-ed children need not re-import a `__main__` that has no file;
- a failure becomes one `WorkerFailed` naming the rank, the host and the worker's exception.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import cloudpickle

from .errors import UsageError, WorkerFailed


def cpu_count() -> int:
    """Cores this process may use (respects taskset / cgroup affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def auto_nproc(device_type: str) -> int:
    """`--nproc auto`: one process per visible GPU; on CPU one process per 4 cores, at least 1.

    CPU processes each run several intra-op threads; small models gain little from more than
    about four threads per process, while every extra process costs start-up and all-reduce
    time. On a 2-core machine this gives a single process with both cores.
    """
    if device_type == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, cpu_count() // 4)


def parse_nproc(value: str | int, device_type: str) -> int:
    if isinstance(value, int) or str(value).isdigit():
        n = int(value)
        if n < 1:
            raise UsageError(f"--nproc must be a positive integer or 'auto', got {value}")
        return n
    if value == "auto":
        return auto_nproc(device_type)
    raise UsageError(f"--nproc must be a positive integer or 'auto', got {value!r}")


def threads_per_process(nproc: int) -> int:
    return max(1, cpu_count() // nproc)


def _entrypoint(payload: bytes) -> Any:
    # Runs in each worker; the agent wraps it in `record`, which writes the traceback to the
    # error file it reads, so the parent learns *why* a rank failed, not only its exit code.
    import pickle

    fn, args, kwargs = pickle.loads(payload)
    return fn(*args, **kwargs)


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


@dataclass(frozen=True)
class Nodes:
    """Where the rendezvous is. One machine: loopback, a port the OS picks. Several: every node
    runs the same command with the first node's address; torch's c10d rendezvous assigns ranks."""

    nnodes: str = "1"  # N, or MIN:MAX for an elastic range
    node_rank: int | None = None  # 0 marks the node that hosts the rendezvous
    master_addr: str | None = None
    master_port: int = 29500
    run_id: str | None = None  # the same on every node; default derived from the endpoint

    def range(self) -> tuple[int, int]:
        try:
            lo, _, hi = self.nnodes.partition(":")
            low, high = int(lo), int(hi or lo)
        except ValueError:
            low = high = 0
        if not 1 <= low <= high:
            raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.nnodes!r}")
        return low, high


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
    elastic agent. `device` ('auto', 'cpu' or 'cuda') only matters for `nproc='auto'`:
    one process per visible GPU, or on CPU one per 4 cores.
    """
    n = parse_nproc(nproc, _device(device))
    payload = cloudpickle.dumps((fn, args, kwargs))
    results = _elastic(n, nodes, max_restarts, _entrypoint, (payload,), output="inherit")
    return dict(sorted(results.items()))  # the agent lists them in the order workers finished


def run_script(script: str, args: list[str], *, nproc: int | str = "auto", max_restarts: int = 0,
               nodes: Nodes = Nodes(), output: str = "prefixed", module: bool = False) -> None:
    """Run a script written for torchrun (or for ddpkit's Runtime) on `nproc` processes per
    node: `python -u SCRIPT ARGS...` (or `-m MODULE`) with RANK, WORLD_SIZE, MASTER_ADDR, ...
    set. `output` is 'prefixed' ("[rank3]: ..." per line) or 'rank0' (other local ranks'
    output goes to the log directory only)."""
    import sys as _sys

    n = parse_nproc(nproc, _device("auto"))
    target = ["-m", script] if module else [script]
    _elastic(n, nodes, max_restarts, _sys.executable, ("-u", *target, *args), output=output)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to `host`: what the other nodes can reach us at.

    The hostname is the usual guess, and a poor one: it may resolve to 127.0.1.1 or to an
    interface the other nodes cannot reach. Connecting a UDP socket sends nothing; it only
    asks the kernel which local address it would send from.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
        except OSError as err:
            raise UsageError(f"--master-addr {host}: no route to it ({err.strerror})") from None
        return s.getsockname()[0]


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _elastic(n: int, nodes: Nodes, max_restarts: int, entrypoint: Any, args: tuple, output: str) -> Any:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    low, high = nodes.range()
    logs = tempfile.mkdtemp(prefix="ddpkit-launch-")
    if high == 1:
        # Port 0 on loopback: the OS picks a free port when the store binds, so two jobs never
        # collide, and nothing listens beyond this machine.
        rdzv = {"rdzv_endpoint": "127.0.0.1:0", "rdzv_configs": {"is_host": True}, "local_addr": "127.0.0.1",
                "run_id": f"ddpkit-{uuid.uuid4().hex[:12]}"}
    else:
        addr = nodes.master_addr or os.environ.get("MASTER_ADDR")
        if not addr:
            raise UsageError("--nnodes above 1 needs --master-addr: the address of the node that hosts the rendezvous")
        configs = {} if nodes.node_rank is None else {"is_host": nodes.node_rank == 0}
        rdzv = {"rdzv_endpoint": f"{addr}:{nodes.master_port}", "rdzv_configs": configs,
                "run_id": nodes.run_id or f"ddpkit-{addr}-{nodes.master_port}",
                "local_addr": route_address(addr, nodes.master_port)}
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
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        log_line_prefix_template="[rank${rank}]: " if output != "inherit" else None,
        **rdzv,
    )
    try:
        # Each process gets its share of the cores instead of all of them (oversubscription
        # makes CPU DDP several times slower). A value the user set is kept.
        # A store shared between rendezvous and workers keeps the previous attempt's keys, so
        # restarted workers can read stale peer addresses (pytorch/pytorch#135712): let each
        # attempt's workers have a store of their own.
        with _env("OMP_NUM_THREADS", str(threads_per_process(n))), _env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"), \
                _quiet_elastic_logs(), _main_hidden():
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        raise _as_worker_failed(err, logs) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Hide `__main__`'s file and module name from `spawn` while the workers start.

    `spawn` re-runs the parent's main script (or module) in every child. That fails where there
    is no file (`python -` sets '<stdin>') and re-runs unguarded top-level code (a script with
    no `if __name__ == "__main__":`). The function and its arguments travel by value, so the
    children need nothing from `__main__`. Notebooks have neither attribute to hide.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    if "__file__" in saved:
        del main.__file__
    if "__spec__" in saved:
        main.__spec__ = None
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


# Errors a healthy rank raises because a peer died under it. They are consequences, not causes.
_PEER_LOSS = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
              "DistBackendError", "DistNetworkError", "failed to recv", "NCCL communicator was aborted",
              "remote process exited")


def _as_worker_failed(err: Any, logs: str) -> WorkerFailed:
    """The root cause among all ranks that failed: a rank's own exception beats a peer-loss
    error or a kill by the agent; then the earliest; then the lowest rank."""
    # rank -> (exitcode, when, traceback). The error files' own timestamps are whole seconds,
    # so when is the file's modification time, which has sub-second resolution.
    found: dict[int, tuple[int, float, str]] = {}
    # Error files are per local rank; the failures the agent reports give this node's offset.
    offset = next((rank - f.local_rank for rank, f in err.failures.items()), 0)
    for rank, failure in err.failures.items():
        when = os.path.getmtime(failure.error_file) if os.path.isfile(failure.error_file) else float("inf")
        found[rank] = (failure.exitcode, when, _traceback_of(failure.error_file_data))
    attempts = sorted(glob.glob(os.path.join(logs, "*", "attempt_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    for path in glob.glob(os.path.join(attempts[-1], "*", "error.json")) if attempts else []:
        rank = offset + int(os.path.basename(os.path.dirname(path)))
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        tb = _traceback_of(data)
        if tb and not found.get(rank, (0, 0.0, ""))[2]:
            found[rank] = (found.get(rank, (1, 0.0, ""))[0], os.path.getmtime(path), tb)

    def cause_first(item: tuple[int, tuple[int, float, str]]) -> tuple[bool, bool, float, int]:
        rank, (exitcode, stamp, tb) = item
        consequence = any(marker in tb for marker in _PEER_LOSS)
        # The agent stops the others with SIGTERM; any other signal (SIGKILL from the OOM
        # killer, SIGSEGV) is a cause in its own right.
        stopped_by_agent = exitcode == -signal.SIGTERM and not tb
        return (consequence, stopped_by_agent, stamp, rank)

    rank, (exitcode, _, tb) = min(found.items(), key=cause_first)
    if tb:
        message = tb.strip().splitlines()[-1]  # "ValueError: boom"; the traceback goes along
    elif exitcode < 0:
        message = f"killed by {_signal_name(-exitcode)}"
    else:
        message = f"exited with code {exitcode}"
    return WorkerFailed(rank, socket.gethostname(), message, exitcode, tb)


def _traceback_of(error_file_data: Any) -> str:
    data = error_file_data.get("message", {}) if isinstance(error_file_data, dict) else {}
    return data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
