"""Start N local workers through torch's elastic launcher, and report the first failure by rank.

ddpkit manages no processes itself: `torch.distributed.launcher.api.elastic_launch` starts the
workers, runs the rendezvous, watches them, and stops the others when one fails. This module
adds what the tutorials get wrong by hand:

- no fixed MASTER_PORT: the rendezvous binds port 0 on the loopback address and the OS picks;
- functions from a notebook or from `python -` on stdin work: the function is pickled by value
  (cloudpickle), so the `spawn`-ed children need not re-import a `__main__` that has no file;
- a failure becomes one `WorkerFailed` naming the rank, the host and the worker's exception;
- on CPU the workers are forked, not spawned (see `_start_method`): they inherit the parent's
  imported torch instead of importing it again, and exit without a second interpreter teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
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


def _entrypoint(payload: bytes, forked: bool = False) -> Any:
    # Runs in each worker; the agent wraps it in `record`, which writes the traceback to the
    # error file it reads, so the parent learns *why* a rank failed, not only its exit code.
    import pickle

    if forked:
        _like_a_spawned_worker()
    fn, args, kwargs = pickle.loads(payload)
    try:
        return fn(*args, **kwargs)
    finally:
        if not forked:
            # A spawned worker ends with a full interpreter teardown, whose garbage collection
            # walks every object torch and its compiler created: about a second. The worker is
            # done with them. (A forked one leaves with os._exit and skips the teardown.)
            gc.freeze()


def _like_a_spawned_worker() -> None:
    """Undo what a forked worker inherits and a spawned one would not have."""
    # The agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a Python exception in its own
    # process before it forks. A worker it stops must die at once, as a spawned one does: the
    # exception would only be raised when a blocking call returns to Python (the agent waits
    # 30 s, then SIGKILLs), and the unwinding worker would leave a traceback that reads like a
    # cause of the failure rather than a consequence.
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # A spawned worker's torch reads OMP_NUM_THREADS when it is imported; this one's was
    # imported by the parent, with the parent's count (all cores: oversubscription).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    # NumPy's global stream would otherwise be the parent's, the same on every rank; a
    # spawned worker seeds it from the OS. (Python's `random` reseeds itself after a fork.)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


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
    elastic agent. `device` ('auto', 'cpu' or 'cuda') decides `nproc='auto'` (one process per
    visible GPU, or on CPU one per 4 cores) and how workers start: when it resolves to 'cpu'
    they are forked from this process (fast), so they must not use CUDA; with 'cuda' they are
    spawned afresh. Set DDPKIT_START_METHOD=spawn to always spawn.
    """
    kind = _device(device)
    n = parse_nproc(nproc, kind)
    payload = cloudpickle.dumps((fn, args, kwargs))
    method = _start_method(kind)
    results = _elastic(n, nodes, max_restarts, _entrypoint, (payload, method == "fork"), output="inherit",
                       start_method=method)
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


def _start_method(device_type: str) -> str:
    """'fork' where forking this process is safe, else 'spawn'.

    A spawned worker starts a fresh interpreter and imports torch again (over a second on a
    small machine, more than the training of a small job) and at exit tears that interpreter
    down again. A forked one inherits the imports and leaves with `os._exit`: the whole
    `ddpkit train` of 10 epochs of digits on 2 CPU processes went from 8.0 s to 5.7 s (medians
    on 2 cores, `ddpkit bench startup` measures it).
    Forking is unsafe after CUDA was initialized, from a process that already runs a process
    group or other Python threads, off Linux, and with a GNU OpenMP thread pool that cannot be
    released first: choosing 'fork' releases it (see `_release_openmp`).
    """
    if os.environ.get("DDPKIT_START_METHOD") == "spawn" or device_type != "cpu" or sys.platform != "linux":
        return "spawn"
    if threading.active_count() > 1 or threading.current_thread() is not threading.main_thread():
        return "spawn"
    torch, tdist = sys.modules.get("torch"), sys.modules.get("torch.distributed")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        return "spawn"
    return "fork" if _release_openmp() else "spawn"


def _release_openmp() -> bool:
    """Stop this thread's GNU OpenMP worker threads, so that a forked child starts its own.

    After any multi-threaded torch op, libgomp keeps a pool of threads and a forked child
    inherits the pool's bookkeeping but not its threads: its first parallel op waits for them
    forever. `omp_pause_resource_all` (OpenMP 5.0) releases the pool; the parent's next
    parallel op makes a new one. LLVM's and Intel's OpenMP handle fork themselves. False
    (spawn instead) if libgomp is loaded and the pool cannot be released.
    """
    try:
        with open("/proc/self/maps") as f:  # address, perms, offset, dev, inode, path
            paths = {fields[5].strip() for fields in (line.split(maxsplit=5) for line in f) if len(fields) == 6}
        libs = [path for path in paths if os.path.basename(path).startswith("libgomp")]
    except OSError:
        return False
    for path in libs:
        try:
            # RTLD_NOLOAD: the library torch already loaded, never a second copy
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            if lib.omp_pause_resource_all(2) != 0:  # 2: omp_pause_hard
                return False
        except (OSError, AttributeError):  # gone, or a libgomp older than GCC 9
            return False
    return True


def _elastic(n: int, nodes: Nodes, max_restarts: int, entrypoint: Any, args: tuple, output: str,
             start_method: str = "spawn") -> Any:
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
        start_method=start_method,  # workers given as a function; a script is always a new process
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
                _quiet_elastic_logs(), _main_hidden() if start_method == "spawn" else _gc_frozen():
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        raise _as_worker_failed(err, logs) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Keep the parent's objects out of the forked workers' garbage collections.

    A forked worker inherits every object of the parent (torch alone makes some 170 000);
    each full collection in the worker would walk them all, and touching them copies their
    memory pages. Frozen objects are skipped: importing torch's compiler in a worker (which
    the first optimizer does) runs about 0.3 s faster. The parent's objects thaw afterwards
    (unless the caller froze some itself: those stay as they were).
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
