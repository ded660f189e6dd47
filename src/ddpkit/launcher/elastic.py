"""Starting workers through torch's elastic launcher.

ddpkit manages no processes itself: `torch.distributed.launcher.api.elastic_launch` starts the
workers, runs the rendezvous, watches them, and stops the others when one fails. This module
adds what the tutorials get wrong by hand:

- no fixed MASTER_PORT: on one machine the rendezvous binds port 0 on the loopback address and
  the OS picks (see `Nodes.rendezvous`);
- each process gets its share of the cores (OMP_NUM_THREADS), not all of them;
- a failure becomes one `WorkerFailed` naming the rank that caused it (see `failures`);
- the rendezvous names its events without `inspect.stack()`, which cost a launch under
  `python -m` about 0.15 s (see `_rendezvous_events_named_by_frame`).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import io
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import cloudpickle

from ..core import checks, threads
from ..core import device as devices
from ..core.signals import set_handler
from ..errors import Interrupted, UsageError
from . import records
from . import store as workers_store
from .failures import as_worker_failed
from .topology import Nodes, Topology, local
from .workers import (
    WORKER_IMPORTS,
    choose_start_method,
    entrypoint,
    gc_frozen,
    main_hidden,
    own_fork_server,
    preloaded,
    signals_never_dropped,
)

# Imports inside functions: torch's elastic agent and rendezvous load in the launching process
# only when it launches (not for `ddpkit.launch` under torchrun, nor in the workers).

# How often the agent looks at its workers: how soon it sees that they finished (or one
# failed). A look costs the launching process a few syscalls: 50 a second cost no CPU time
# that two runs of 10 epochs on 2 cores could tell apart from 10 a second.
MONITOR_INTERVAL_S = 0.02


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
    spawned afresh. Set DDPKIT_START_METHOD=spawn to always spawn, or =forkserver to fork them
    from a fresh process that imported torch once for the job (`workers.own_fork_server`).

    Inside a worker of a job that is already running (started by torchrun, srun or
    `ddpkit run`), `fn` runs in this process, as that worker: {this rank: return value}.
    """
    checks.thread_count_variable()  # the workers inherit it
    from ..core.dist import detect_env

    env = detect_env()
    if env.source != "single":  # this process is a worker already (torchrun, srun, `ddpkit run`)
        if str(nproc) not in ("auto", str(env.local_world_size)) or max_restarts or nodes != Nodes():
            raise UsageError(
                f"launch(nproc={checks.shown(nproc)}) inside a worker of a job of {env.world_size} processes already started "
                f"by {'srun' if env.source == 'slurm' else 'torchrun or ddpkit run'}: size the job with that launcher"
            )
        return {env.rank: fn(*args, **kwargs)}
    topo = local(devices.device_type(device, what="device"), nproc, nodes, max_restarts)
    return run_function(topo, fn, *args, **kwargs)


def run_function(
    topo: Topology,
    fn: Callable[..., Any],
    *args: Any,
    announce_restarts: bool = True,
    preload: Sequence[str] = WORKER_IMPORTS,
    **kwargs: Any,
) -> dict[int, Any]:
    """`fn(*args, **kwargs)` on the workers of a resolved `Topology`; {rank: return value}.
    After a restart, rank 0 prints why, unless `announce_restarts` is False (`fn` says it
    itself, with `failures.restart_note`). Forked workers inherit the modules of `preload`,
    imported here while the rendezvous waits (see `workers.preloaded`)."""
    payload = cloudpickle.dumps((fn, args, kwargs))
    method = choose_start_method(topo.device_type)
    if method == "forkserver":  # what the job's fork server imports once for its workers (`own_fork_server`)
        multiprocessing.set_forkserver_preload(["ddpkit.launcher.workers", *preload])
    results = _elastic(
        topo,
        entrypoint,
        (payload, method in ("fork", "forkserver"), announce_restarts),
        output="inherit",
        start_method=method,
        preload=preload if method == "fork" else (),
    )
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
    no_python: bool = False,
    log_dir: str | None = None,
    show_ranks: set[int] | None = None,
) -> None:
    """Run a script written for torchrun (or for ddpkit's Runtime) on `nproc` processes per
    node: `python -u SCRIPT ARGS...` (or `-m MODULE`; or the executable SCRIPT itself with
    `no_python`) with RANK, WORLD_SIZE, MASTER_ADDR, ... set.

    `output` 'prefixed' shows each line as "[rank3]: ..."; 'inherit' leaves the workers' output
    as it is. `show_ranks` are the local ranks whose output is shown (None: all; 'rank0' output
    is {0}); the others' goes to `log_dir` when given, else nowhere. `log_dir` keeps the
    workers' logs and error files after the run."""
    topo = local(devices.device_type("auto"), nproc, nodes, max_restarts)
    if output == "rank0":
        output, show_ranks = "prefixed", {0}
    if no_python:
        _elastic(topo, script, tuple(args), output=output, log_dir=log_dir, show_ranks=show_ranks)
        return
    target = ["-m", script] if module else [script]
    wrapper = ("-u", "-m", "ddpkit.launcher.script", *target, *args)
    _elastic(topo, sys.executable, wrapper, output=output, log_dir=log_dir, show_ranks=show_ranks)


def _elastic(
    topo: Topology,
    entrypoint: Any,
    args: tuple,
    output: str,
    start_method: str = "spawn",
    log_dir: str | None = None,
    show_ranks: set[int] | None = None,
    preload: Sequence[str] = (),
) -> Any:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with _launch_folder(log_dir) as logs:
        config = _launch_config(topo, logs, output, start_method, show_ranks)
        try:
            with (
                _launching(topo.nproc, logs, output, start_method),
                signals_never_dropped(SignalException),
                preloaded(preload),
                _said_while_gathering(topo, logs),
            ):
                return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            raise as_worker_failed(err, logs, _last_attempt(logs)) from None
        except SignalException as err:  # Ctrl-C or SIGTERM: the agent has stopped the workers
            stop_strays()
            raise Interrupted(err.sigval) from None
        except KeyboardInterrupt:  # one that reached Python's own handler (between the agent's handlers)
            stop_strays()
            raise
        finally:
            workers_store.release_all()  # after a signal too, where torch leaves the rendezvous open


LAUNCH_PREFIX = "ddpkit-launch-"  # a launch's folder (`_launch_folder`)
HELD = ".held"  # in a launch's folder: locked (flock) while its launch runs


@contextlib.contextmanager
def _launch_folder(log_dir: str | None) -> Iterator[str]:
    """One folder per launch, for torch's logs and error files and the workers' records: in
    `log_dir`, and kept; else a temporary one, removed as the launch ends. The temporary
    folders of launches killed before they could remove theirs (SIGKILL, out of memory) are
    removed first (`remove_abandoned`). A launch holds a lock on its folder's HELD file while
    it runs (its forked workers share it), so a free lock is a folder no running launch uses."""
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    else:
        remove_abandoned(tempfile.gettempdir())
    logs = tempfile.mkdtemp(prefix=LAUNCH_PREFIX, dir=log_dir)
    held = os.open(os.path.join(logs, HELD), os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield logs
    finally:
        if not log_dir:
            shutil.rmtree(logs, ignore_errors=True)
        os.close(held)


def remove_abandoned(parent: str, settled_s: float = 60.0) -> list[str]:
    """Remove the launch folders in `parent` whose launch is gone: their HELD file's lock is
    free, and it was made more than `settled_s` ago (a launch that has just made its folder
    may not hold the lock yet). Folders without a HELD file (made by an older ddpkit, or not
    ddpkit's), or that this user may not open, are left alone. Returns those removed."""
    removed = []
    for folder in sorted(glob.glob(os.path.join(parent, LAUNCH_PREFIX + "*"))):
        path = os.path.join(folder, HELD)
        try:
            if time.time() - os.stat(path).st_mtime < settled_s:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its launch runs
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        removed.append(folder)
    return removed


def stop_strays(grace_s: float = 5.0) -> list[int]:
    """Stop the workers this process forked that outlived the agent's stop: a signal handled
    between two of the agent's forks raises inside torch's `start_processes`, before the agent
    has recorded the workers it started, so its shutdown does not reach them; they would wait
    for their peers, and this process's exit for them. SIGTERM, SIGKILL after `grace_s`.
    Returns their pids (none after a stop the agent made whole)."""
    import multiprocessing

    strays = multiprocessing.active_children()  # (the agent's finished ones are reaped here)
    for proc in strays:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in strays:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.pid for proc in strays if proc.pid is not None]


def _launch_config(topo: Topology, logs: str, output: str, start_method: str, show_ranks: set[int] | None) -> Any:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    workers_store.register()
    low, high = topo.nodes.range()
    return LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=logs, **_streams(output, topo.nproc, show_ranks)),
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=topo.nproc,
        rdzv_backend=workers_store.BACKEND,
        max_restarts=topo.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method=start_method,  # workers given as a function; a script is always a new process
        log_line_prefix_template="[rank${rank}]: " if output == "prefixed" else None,
        **topo.rendezvous,
    )


@contextlib.contextmanager
def _launching(n: int, logs: str, output: str, start_method: str) -> Iterator[None]:
    """This process, and the environment the workers inherit, while the agent runs them.

    Each process gets its share of the cores instead of all of them (oversubscription makes
    CPU DDP several times slower); a value the user set is kept. Each attempt's rank 0 hosts
    a store of its own (torch's shared store keeps the last attempt's keys:
    pytorch/pytorch#135712), on a port the launch's rendezvous holds for it (`store`). The
    workers keep their records in `logs` (see `records`)."""
    with (
        _threads(n),
        _env(workers_store.UNSHARED, "1", force=True),
        _env(records.LAUNCH_DIR, logs, force=True),
        _signal_handlers_kept(),
        records.ExitWatch(logs).watching(),
        records.agent_stops(logs),
        _quiet_elastic_logs(),
        _rendezvous_events_named_by_frame(),
        _tidy_prefixes() if output == "prefixed" else contextlib.nullcontext(),
        # (the fork server is a fresh interpreter too, started by the job's first worker)
        main_hidden() if start_method in ("spawn", "forkserver") else gc_frozen(),
        own_fork_server() if start_method == "forkserver" else contextlib.nullcontext(),
    ):
        yield


# How long the nodes of a job may take to gather before each launcher says it waits, and then
# how often it says it again (the same as a process started by hand: dist.WAIT_SAID_*).
GATHER_SAID_AFTER_S, GATHER_SAID_EVERY_S = 5.0, 60.0


@contextlib.contextmanager
def _said_while_gathering(topo: Topology, logs: str) -> Iterator[None]:
    """With several nodes, say on stderr what this node waits for while the agent's rendezvous
    gathers them (before its first worker starts): after GATHER_SAID_AFTER_S, then every
    GATHER_SAID_EVERY_S. The rendezvous itself runs in Python in the agent: Ctrl-C and SIGTERM
    end it as at any other time."""
    low, high = topo.nodes.range()
    if high == 1:
        yield
        return
    nodes = str(low) if low == high else f"{low} to {high}"
    where = topo.rendezvous.get("rdzv_endpoint", "?")
    done, started = threading.Event(), time.monotonic()

    def say() -> None:
        wait = GATHER_SAID_AFTER_S
        while not done.wait(wait) and not _workers_started(logs):
            print(
                f"ddpkit: this node has waited {time.monotonic() - started:.0f} s for the job's {nodes} nodes to "
                f"gather at {where} (--nnodes {topo.nodes.nnodes}, --master-addr, --master-port; Ctrl-C stops)",
                file=sys.stderr,
                flush=True,
            )
            wait = GATHER_SAID_EVERY_S

    thread = threading.Thread(target=say, name="ddpkit-gathering", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _workers_started(logs: str) -> bool:
    """Whether the agent has started workers: its folder of an attempt, or a worker's record."""
    return bool(glob.glob(os.path.join(logs, "*", "attempt_*")) or glob.glob(os.path.join(logs, "attempt-*")))


def _streams(output: str, n: int, show_ranks: set[int] | None) -> dict[str, Any]:
    """Which local ranks' output is shown on the console (tee) and which only logged."""
    from torch.distributed.elastic.multiprocessing.api import Std

    if output == "inherit":
        return {}
    shown = set(range(n)) if show_ranks is None else {r for r in show_ranks if 0 <= r < n}
    return {"redirects": {r: Std.ALL for r in range(n) if r not in shown}, "tee": {r: Std.ALL for r in shown}}


def _last_attempt(logs: str) -> int:
    """The agent's last attempt: from its own log folders, made for every attempt (the workers'
    records may be missing, with --no-python or a worker killed as it started)."""
    found = [int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(logs, "*", "attempt_*"))]
    return max(found, default=0)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into exceptions for good; after
    the launch, the caller's handlers apply again."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = [(sig, signal.getsignal(sig)) for sig in sigs]
    try:
        yield
    finally:
        for sig, handler in saved:
            set_handler(sig, handler if handler is not None else signal.SIG_DFL)


_PREFIX = re.compile(r"\[rank\d+\]: ?")


class _PrefixedLines(io.TextIOBase):
    """The console as torch's agent tees the workers' lines into it ("[rank3]: " + line), minus
    a prefix on a blank line, and minus the second prefix of a line that has the same one
    already (torch's excepthook adds its own)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        if (head := _PREFIX.match(text)) is not None:
            rest = text[head.end() :]
            if not rest.strip() or rest.startswith(head.group().rstrip()):
                text = rest
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def _tidy_prefixes() -> Iterator[None]:
    """While the agent starts its tee threads, they take sys.stdout and sys.stderr: these."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PrefixedLines(sys.stdout), _PrefixedLines(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


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


# Launches under way whose rendezvous names its events by frame, and torch's own function,
# which the last of them to end puts back (launches may overlap, from several threads).
_naming = {"launches": 0, "torch_own": None}
_naming_lock = threading.Lock()


@contextlib.contextmanager
def _rendezvous_events_named_by_frame() -> Iterator[None]:
    """The c10d rendezvous names each event it records after the method that records it, which
    it finds with `inspect.stack()` (its `get_method_name`), even when the event then goes to a
    handler that drops it. `inspect.stack()` reads every frame's source, and for a frame with
    no file, as `python -m` leaves at the bottom of the stack (runpy is frozen), it scans every
    loaded module: some 2000 once torch is imported, 7 to 13 ms a call, two calls an event. A
    launch records about ten at its start, on the GIL beside the workers' preload, and some at
    its end: about 0.15 s of a 4.5 s job (`workers_started` and `workers_exited`, docs/speed.md). For the launch's duration, the same name is read from the
    frame itself (`sys._getframe`: the frame `depth` calls up, as `inspect.stack()[depth]`)."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    except ImportError:
        yield
        return
    with _naming_lock:
        if getattr(rdzv, "get_method_name", None) is None:  # torch no longer names events this way
            named = False
        else:
            named = True
            if _naming["launches"] == 0:
                _naming["torch_own"] = rdzv.get_method_name
            _naming["launches"] += 1
            rdzv.get_method_name = method_name
    try:
        yield
    finally:
        if named:
            with _naming_lock:
                _naming["launches"] -= 1
                if _naming["launches"] == 0:
                    rdzv.get_method_name = _naming["torch_own"]


def method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one (`inspect.stack()[depth]`'s
    `function`, without reading any source), or "no_method_name" past the stack's bottom, as
    torch's rendezvous says it."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """The workers' OMP_NUM_THREADS, unless the user set it: chosen here, where the load reading
    spans this process's start-up (see ddpkit.core.threads), with why in DDPKIT_THREADS_CHOSEN."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    count, why = threads.choose(n)
    with _env("OMP_NUM_THREADS", str(count)), _env(threads.CHOSEN, why, force=True):
        yield


@contextlib.contextmanager
def _env(name: str, value: str, force: bool = False) -> Iterator[None]:
    """Set an environment variable for the workers unless the user set it (or anyway, with
    `force`); restore afterwards."""
    if name in os.environ and not force:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
