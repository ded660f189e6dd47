"""Process-group setup and teardown, rank facts, and the collectives a training loop needs.

This is the only module that calls `torch.distributed.init_process_group`. Everything here
also works with a single process and no process group, so user code need not branch on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from ..errors import UsageError
from .checks import cut
from .signals import set_handler


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, and who told us (torchrun, slurm or single)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "single"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# What a launcher (torchrun, ddpkit's own) sets for its workers; srun's are the SLURM_* ones.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS",
)


def environ_outside_job(*also: str) -> dict[str, str]:
    """This process's environment without a launcher's or srun's variables (nor the `also`
    names): what a fresh job started from here, inside another one, must see."""
    return {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k not in also and not k.startswith("SLURM_")
    }


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[07-09,12],cpu1' -> 'gpu07'.

    Saves a call to `scontrol show hostnames`, which is not on every compute node's PATH.
    """
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_env() -> DistEnv:
    """Read rank and world size from torchrun's variables, else SLURM's, else a single process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistEnv(
            rank=_int_env("RANK", 0),
            local_rank=_int_env("LOCAL_RANK", 0),
            world_size=_int_env("WORLD_SIZE", 1),
            local_world_size=_int_env("LOCAL_WORLD_SIZE", 1),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env("MASTER_PORT", 0),
            source="torchrun",
        )
    if _int_env("SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        # Inside `srun`: one task per process. The port is derived from the job id so every task
        # agrees on it without talking, the way Lightning does it.
        job_id = _int_env("SLURM_JOB_ID", 0)
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        ntasks = _int_env("SLURM_NTASKS", 1)
        return DistEnv(
            rank=_int_env("SLURM_PROCID", 0),
            local_rank=_int_env("SLURM_LOCALID", 0),
            world_size=ntasks,
            local_world_size=ntasks // max(1, _int_env("SLURM_NNODES", 1)),
            master_addr=os.environ.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=_int_env("MASTER_PORT", 15000 + job_id % 20000),
            source="slurm",
        )
    return DistEnv()


def job_problem(env: DistEnv) -> str | None:
    """Why launcher variables in this environment cannot describe a job this process is part
    of (None: they can, or there are none). A RANK and WORLD_SIZE left set by hand, with no
    launcher around, would make this process wait for peers that never come, until the
    timeout; they are caught here instead."""
    if env.source == "single" or env.world_size <= 1:
        return None
    said = f"RANK={env.rank} WORLD_SIZE={env.world_size}" if env.source == "torchrun" else f"srun's task {env.rank}"
    if not 0 <= env.rank < env.world_size:
        return f"{said}: the rank is not one of the job's {env.world_size}"
    if env.source == "torchrun" and env.master_port == 0:
        return (
            f"{said} are set, describing a job of {env.world_size} processes, but MASTER_PORT is not: no other "
            "process could find this one. Unset them to run alone, or start the job with torchrun or ddpkit run"
        )
    return None


def backend_for(device: torch.device, cpu_collectives: bool = False) -> str:
    """gloo on CPU, NCCL on CUDA; with `cpu_collectives`, NCCL for CUDA tensors and gloo for
    CPU ones (fsdp's CPU offload keeps the shards and their gradients in host memory)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


# Waiting while rank 0 writes a checkpoint or the final outputs is not a stalled peer: those
# waits (wait_for_main) last at least this long, so a short --timeout can still catch ranks
# that stop reaching collectives without failing every slow save.
IO_TIMEOUT_S = 1800.0
_io_group: Any = None  # a gloo group of at least that timeout (see wait_for_main)
_main_wait: timedelta | None = None  # rank 0's own wait there: the job's timeout, where ddpkit made the group
_main_waits = 0  # this process's calls of wait_for_main in its group: each one's keys in the store


def init(env: DistEnv, device: torch.device, timeout_s: float = 600.0, cpu_collectives: bool = False) -> bool:
    """Create the default process group for `env` unless one exists. True if this call made it.
    `cpu_collectives`: on CUDA, also reduce CPU tensors (see backend_for).

    Does nothing for a single process: every helper below works without a group.
    """
    if not env.is_distributed or tdist.is_initialized():
        return False
    problem = job_problem(env)
    if problem:
        raise UsageError(problem)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    global _groups_made
    _groups_made += 1
    # The processes meet here, in a wait that says what it waits for and that Ctrl-C and
    # SIGTERM end (torch's own waits in C++ until the timeout).
    kwargs: dict[str, Any] = {"store": rendezvous(env, timeout_s)}
    if _groups_made > 1:
        # A group made again in this process (a second Runtime after the first closed its own):
        # the store still holds the last group's addresses under the names torch gives them, so
        # a rank could dial a port that closed. Each group meets under keys of its own.
        kwargs["store"] = tdist.PrefixStore(f"ddpkit/group-{_groups_made}", kwargs["store"])
    if device.type == "cuda":
        # Binding the group to the device lets NCCL set up eagerly and avoids the
        # "guessing device id" warning on the first barrier.
        kwargs["device_id"] = device
    with _interruptible_in_cpp():
        tdist.init_process_group(
            backend=backend_for(device, cpu_collectives),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        global _io_group, _main_wait
        _io_group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, IO_TIMEOUT_S)))
        _main_wait = timedelta(seconds=timeout_s)
    return True


@contextlib.contextmanager
def _interruptible_in_cpp() -> Iterator[None]:
    """In a launcher's worker, Ctrl-C ends the process at once while its groups connect: the
    connection waits in C++ for the peers' addresses, holding the KeyboardInterrupt until the
    launcher, stopping, closes its store under it, and torch then prints that failure as a
    warning with a C++ stack before the launcher's own line. The launcher says it was
    interrupted; the worker has nothing to add, nor anything to clean up yet."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = set_handler(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        set_handler(signal.SIGINT, previous)


_groups_made = 0  # default process groups this process created (see init)

# How long a process waits for its peers before it says so, and then how often it says it again.
WAIT_SAID_AFTER_S, WAIT_SAID_EVERY_S = 5.0, 60.0
_rendezvous_count = 0  # this process's meetings: each has a key of its own in a reused store


def rendezvous(env: DistEnv, timeout_s: float) -> Any:
    """The store through which `env`'s processes meet, once all `env.world_size` have joined
    it. The workers of an agent that shares its store (TORCHELASTIC_USE_AGENT_STORE=True:
    torchrun's default) all connect to the store it hosts at MASTER_ADDR:MASTER_PORT
    (`agent_attempt`); otherwise (ddpkit's launcher, srun, processes started by hand) rank 0
    hosts it there and the others connect to it.

    The wait is a loop of short calls, so a signal handler runs within a fraction of a second:
    Ctrl-C and SIGTERM end it (torch's own rendezvous waits in C++ for the whole timeout, signals
    held). After `WAIT_SAID_AFTER_S` a waiting process says on stderr what it waits for (every
    one that was started by hand; rank 0 alone among a launcher's workers). A job that does not
    gather within `timeout_s`, or a port another program holds, is a UsageError: the environment
    describes a job that is not there."""
    global _rendezvous_count
    _rendezvous_count += 1
    clock = _WaitClock(env, timeout_s)
    key = f"ddpkit/joined/{_rendezvous_count}"
    if clock.agent_store:
        store = _connect(env, clock)
        attempt = agent_attempt()
        if attempt is not None:
            store = tdist.PrefixStore(f"ddpkit/attempt-{attempt}", store)
        _join(store, key, env, clock)
        return store
    if env.rank == 0:
        try:
            store = tdist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
                multi_tenant=True,
            )
        except (RuntimeError, OSError) as err:  # DistNetworkError is a RuntimeError
            raise _cannot_host(env, err) from None
        _join(store, key, env, clock)
        return store
    while True:
        store = _connect(env, clock)
        try:
            _join(store, key, env, clock)
            return store
        except RuntimeError:  # rank 0's store went away (a Runtime before this one, closing): again
            clock.tick(f"rank 0's store at {clock.where} to answer")


def agent_attempt() -> str | None:
    """The attempt this worker belongs to, when its keys need one in the agent's store: under
    torchrun on one node. torch 2.13's agent keeps one store for all the attempts of a launch,
    so a restarted worker would read the last attempt's keys (gloo dials peer addresses that
    closed with the old workers: pytorch/pytorch#135712); one agent counts the attempts for
    all its workers. None with several nodes, whose agents count their restarts each on its
    own (the issue's cause). (The count does not move when an elastic job's membership
    changes without a failure: a job of `--nnodes 1:2` back on one node would meet under the
    keys of its last attempt on one node. ddpkit's launcher shares no store: `launcher.store`.)"""
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _join(store: Any, key: str, env: DistEnv, clock: _WaitClock) -> None:
    """Count this process into `key` and wait until the whole job has."""
    joined = store.add(key, 1)
    while joined < env.world_size:
        clock.tick(f"{env.world_size - joined} more of the job's {env.world_size} processes to join at {clock.where}")
        joined = store.add(key, 0)


def _connect(env: DistEnv, clock: _WaitClock) -> Any:
    """A client of the job's store (rank 0's, or the agent's). torch's client retries a
    refused connection in C++ for the whole timeout, logging each try, and waits for a
    handshake that a program other than the store never sends: a plain connection finds out when something listens, and the client is
    made in a thread of its own (the call lets go of the GIL) while this one waits."""
    while True:
        while not _accepts(env.master_addr, env.master_port):
            clock.tick(f"{clock.store} at {clock.where} to answer")
        made: dict[str, Any] = {}
        thread = threading.Thread(
            target=_client, args=(env, clock.timeout_s, made), name="ddpkit-store-client", daemon=True
        )
        thread.start()
        while thread.is_alive():  # left behind if it never returns: a daemon, it does not hold the exit
            clock.tick(f"an answer from {clock.where}, which accepts connections but may not be {clock.store}")
            thread.join(0.0)
        if "store" in made:
            return made["store"]
        clock.tick(f"{clock.store} at {clock.where} to answer")  # refused after all: it may be going


def _client(env: DistEnv, timeout_s: float, made: dict[str, Any]) -> None:
    """Connect to the job's store: `made['store']`, or `made['error']`."""
    try:
        made["store"] = tdist.TCPStore(
            env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, OSError) as err:
        made["error"] = err


def _accepts(host: str, port: int) -> bool:
    """Whether something listens at host:port (closed at once: the store ignores it)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


class _WaitClock:
    """Paces a wait loop: sleeps a little, says what is awaited once it has taken a while, and
    gives up at the timeout."""

    def __init__(self, env: DistEnv, timeout_s: float):
        self.timeout_s, self.where = timeout_s, f"{env.master_addr}:{env.master_port}"
        # whose store the job meets at: torchrun's agent shares its own with its workers
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.store = "the agent's store" if self.agent_store else "rank 0's store"
        self.who = f"rank {env.rank} of {env.world_size}"
        self.launched = "TORCHELASTIC_RUN_ID" in os.environ  # a launcher's worker: its peers were all started
        if self.launched:
            self.said = "its launcher's workers"
        elif env.source == "torchrun":
            self.said = "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
        else:
            self.said = "srun's SLURM_* variables"
        self.says = env.rank == 0 or not self.launched  # one line for a launcher's job, not one per worker
        self.start = time.monotonic()
        self.next_said = self.start + WAIT_SAID_AFTER_S

    def tick(self, awaited: str) -> None:
        now = time.monotonic()
        waited = now - self.start
        if waited > self.timeout_s:
            hint = (
                "A worker did not reach its process group in time"
                if self.launched
                else "Start every process of it, or unset those variables to run alone"
            )
            raise UsageError(
                f"{self.who}: waited {waited:.0f} s for {awaited}; the job its environment describes "
                f"({self.said}, meeting at {self.where}) did not gather. {hint}"
            )
        if self.says and now >= self.next_said:
            print(
                f"ddpkit: {self.who} has waited {waited:.0f} s for {awaited} (Ctrl-C stops)",
                file=sys.stderr,
                flush=True,
            )
            self.next_said = now + WAIT_SAID_EVERY_S
        time.sleep(0.2)


def _cannot_host(env: DistEnv, err: BaseException) -> Exception:

    text = str(err)
    if "in use" in text.lower() or "EADDRINUSE" in text:
        return UsageError(
            f"MASTER_PORT={env.master_port} is in use on {env.master_addr}: rank 0 cannot host the job's store "
            "there. Choose a free port (ddpkit run picks one itself)"
        )
    return UsageError(f"rank 0 cannot host the job's store at {env.master_addr}:{env.master_port}: {cut(text)}")


def teardown() -> None:
    global _io_group, _background, _main_wait
    _io_group = _background = _main_wait = None  # held, they would keep the old group's store alive
    if tdist.is_initialized():
        tdist.destroy_process_group()


_background: tuple[Any, Any] | None = None  # (the default group it was made in, the group)


def background_group() -> Any:
    """A gloo group of its own for collectives run from a background thread (DCP's asynchronous
    save): they must not interleave with the training's on one group, which gloo aborts on.
    Made on first use under each default group, by every rank: collective."""
    global _background
    world = tdist.group.WORLD
    if _background is None or _background[0] is not world:
        _background = (world, tdist.new_group(backend="gloo"))
    return _background[1]


def compare_everywhere(name: str, value: int, wait_s: float | None = None) -> dict[int, int] | None:
    """Whether every rank has the same `value` for `name`, found through the job's store rather
    than a collective: a rank may call this while the others are inside a collective of the
    training (where a collective of its own would be mismatched with theirs).

    None when every rank posted the same value (or there is no store to post to: one process,
    or a torch without one). Otherwise every rank's value that was posted, by rank: all of them
    when they differ, fewer when some rank did not post within `wait_s` (default: nine tenths of
    the store's timeout, the process group's, so that a rank waiting here gives up just before
    its peers' collective would). A healthy call costs each rank a few store requests, whatever
    the number of ranks; the values are read only when they differ. Each `name` is posted once."""
    if world_size() == 1:
        return None
    try:
        store = tdist.distributed_c10d._get_default_store()  # private: a torch without it has no check
    except (AttributeError, RuntimeError, ValueError):
        return None
    wait_s = compare_wait_s() if wait_s is None else wait_s
    # (a restarted job's workers may share the store with the attempt before: torchrun's agent store)
    key = f"ddpkit/compared/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"
    mine = str(int(value))
    store.set(f"{key}/{rank()}", mine)
    if store.compare_set(f"{key}/first", "", mine) != mine.encode():  # another rank's came first, and differs
        store.set(f"{key}/differ", "1")
    deadline = time.monotonic() + wait_s
    count = _counted(store, f"{key}/count", deadline)  # after the flag: whoever counts all has seen it
    if count < world_size():
        return _values(store, key)
    values = _values(store, key) if store.check([f"{key}/differ"]) else None
    # Rank 0 may host the store (ddpkit's own rendezvous), which goes when its process does: it
    # leaves once every rank has read what it needs from it.
    if rank() == 0:
        _counted(store, f"{key}/read", deadline)
    else:
        store.add(f"{key}/read", 1)
    return values


def _values(store: Any, key: str) -> dict[int, int]:
    keys = [f"{key}/{r}" for r in range(world_size())]
    posted = [r for r in range(world_size()) if store.check([keys[r]])]
    return {r: int(v) for r, v in zip(posted, store.multi_get([keys[r] for r in posted]))}


def _counted(store: Any, key: str, deadline: float) -> int:
    """Count this rank into `key`, then wait until every rank has or the deadline passes (an
    ever slower poll, at most 20 a second); returns the count."""
    count, pause = store.add(key, 1), 0.001
    while count < world_size() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        count = store.add(key, 0)
    return count


def compare_wait_s() -> float:
    """How long `compare_everywhere` waits for the other ranks by default: nine tenths of the
    job's store timeout (the process group's)."""
    return tdist.distributed_c10d._get_default_store().timeout.total_seconds() * 0.9


def world_size() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def is_main() -> bool:
    """True on the process that writes files and prints: global rank 0."""
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        tdist.barrier()


def wait_for_main(local: bool = False) -> None:
    """Barrier for the other ranks while rank 0 does slow work alone (writing files): uses the
    long-timeout group when ddpkit made the process group, else the default one. Rank 0 comes
    last, its work done, and joins only once every other rank has said in the job's store that
    it is there, waiting for that as long as the job's timeout: a rank stopped or hung before
    the barrier is named then, where it kept rank 0 in the barrier for the long timeout's 30
    minutes. (Not a timeout on the barrier itself: gloo cannot cancel a barrier under way, and
    the group's end waits for it. Not the store for the whole wait: a rank waiting on the store
    of a rank 0 that failed writing prints the store's C++ stack.) `local`: each machine's
    local rank 0 did the work, and every rank meets in the barrier, with the long timeout."""
    if world_size() <= 1:
        return
    if not local and _main_wait is not None:
        global _main_waits
        _main_waits += 1
        store = tdist.distributed_c10d._get_default_store()
        prefix = f"ddpkit/at-main-wait/{_groups_made}/{_main_waits}"
        if not is_main():
            store.set(f"{prefix}/{rank()}", "1")
        else:
            keys = [f"{prefix}/{r}" for r in range(1, world_size())]
            try:
                store.wait(keys, _main_wait)  # they came before rank 0's work ended, unless stopped or hung
            except (RuntimeError, tdist.DistStoreError) as err:
                missing = [r for r, key in enumerate(keys, start=1) if not store.check([key])]
                raise RuntimeError(
                    f"rank(s) {', '.join(map(str, missing))} did not come to wait for rank 0's write within "
                    f"{_main_wait.total_seconds():g} s (the job's timeout)"
                ) from err
    tdist.barrier(group=_io_group)


def group_size(group: Any = None) -> int:
    """How many ranks `group` holds (None: the whole job; 1 without a process group)."""
    return tdist.get_world_size(group) if tdist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce with op 'sum', 'mean', 'max' or 'min' over `group` (None: every
    rank); returns the tensor."""
    n = group_size(group)
    if n == 1:
        return tensor
    if op == "mean":
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM, group=group)
        return tensor.div_(n)
    ops = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}
    tdist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def gather_rows(tensor: torch.Tensor, group: Any = None) -> list[list[float]]:
    """Every rank's 1-d tensor (of the same length on every rank), as Python numbers, in rank
    order: one collective. Where a sum must not depend on how a collective orders its
    additions, add the rows up on the host (`math.fsum`: exactly rounded). Over `group` (None:
    every rank)."""
    n = group_size(group)
    if n == 1:
        return [tensor.tolist()]
    out = tensor.new_empty(n * tensor.numel())
    gather_into(out, tensor.contiguous(), group=group)
    return out.view(n, -1).tolist()


# torch 2.13 renamed these two (all_gather_single, reduce_scatter_single) and warns on every call
# by the old names, which older releases have alone
def gather_into(out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
    """`out` filled with every rank's `tensor`, in rank order (torch's all-gather into one tensor)."""
    return (getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor)(out, tensor, group=group)


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
    """`out` holding this rank's part of the sum of every rank's `tensor` (torch's reduce-scatter)."""
    return (getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor)(out, tensor, group=group)


def all_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's tensor (of `group`; None: every rank), in rank order. Sizes may differ
    between ranks along any dimension as long as the number of dimensions agrees: shapes are
    exchanged first, then padded data."""
    n = group_size(group)
    if n == 1:
        return [tensor]
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(n)]
    tdist.all_gather(shapes, shape, group=group)
    max_shape = torch.stack(shapes).max(dim=0).values.tolist()
    padded = tensor.new_zeros(max_shape)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    gathered = [torch.empty_like(padded) for _ in range(n)]
    tdist.all_gather(gathered, padded, group=group)
    return [g[tuple(slice(0, s) for s in sh.tolist())] for g, sh in zip(gathered, shapes)]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite `tensors` in place with rank `src`'s: one broadcast per dtype (the tensors of
    a dtype are flattened into one)."""
    if world_size() == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        tdist.broadcast(flat, src=src)
        offset = 0
        for t in same:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """The `src` rank's Python object (a global rank), on every rank (of `group`; None: every rank)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's Python object (of `group`; None: every rank), in rank order, on every rank."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    tdist.all_gather_object(out, obj, group=group)
    return out
