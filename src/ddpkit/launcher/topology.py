"""Where a job's processes run, resolved before any starts: the device type, how many
processes this machine starts, the nodes and their rendezvous, or the processes torchrun or
srun already started.

`resolve` is the one place `--device`, `--nproc`, `--nnodes`, `--master-addr` and
`--max-restarts` are checked against each other and against this machine.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import checks
from ..core import device as devices
from ..errors import UsageError

# --rdzv-conf keys that torch's c10d rendezvous reads, and the kind of each value: each is
# passed on to torch, typed as c10d reads it; an unknown key is refused, not silently ignored.
RDZV_CONF: dict[str, str] = {
    "is_host": "bool",  # this node hosts the rendezvous store (default: from --node-rank)
    "join_timeout": "seconds",
    "last_call_timeout": "seconds",
    "close_timeout": "seconds",
    "heartbeat_timeout": "seconds",
    "read_timeout": "seconds",
    "timeout": "seconds",
    "keep_alive_interval": "seconds",
    "keep_alive_max_attempt": "number",
}
_BOOLS = {"1": True, "true": True, "t": True, "yes": True, "y": True}
_BOOLS |= {"0": False, "false": False, "f": False, "no": False, "n": False}


@dataclass(frozen=True)
class Nodes:
    """Where the rendezvous is. One machine: loopback, a port the OS picks. Several: every node
    runs the same command with the first node's address; torch's c10d rendezvous assigns ranks
    (in the order of the nodes' addresses, then of their launchers' process ids: `--node-rank`
    only decides which node hosts the rendezvous)."""

    nnodes: str | int = "1"  # N, or MIN:MAX for an elastic range (kept as a string)
    node_rank: int | None = None  # 0 marks the node that hosts the rendezvous
    master_addr: str | None = None
    master_port: int = 29500  # 0 on one machine only: the OS picks it there anyway
    run_id: str | None = None  # the same on every node; default derived from the endpoint
    local_addr: str | None = None  # this node's address for the others; default: the route's
    rdzv_conf: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()  # c10d settings (RDZV_CONF); kept as pairs

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, int) and not isinstance(self.nnodes, bool):
            object.__setattr__(self, "nnodes", str(self.nnodes))  # Nodes(2, ...) as Nodes("2", ...)
        if not isinstance(self.nnodes, str):
            raise UsageError(f"--nnodes must be N or MIN:MAX, got {checks.shown(self.nnodes)}")
        _, high = self.range()
        if self.node_rank is not None and (not _is_int(self.node_rank) or self.node_rank < 0):
            raise UsageError(f"--node-rank must be an integer >= 0, got {checks.shown(self.node_rank)}")
        self._check_port(high)
        conf = dict(self.rdzv_conf)
        object.__setattr__(self, "rdzv_conf", tuple((k, _conf_value(k, v)) for k, v in sorted(conf.items())))

    def _check_port(self, max_nodes: int) -> None:
        # Checked here, not when a socket meets it: a port above 65535 is an OverflowError there.
        port = self.master_port
        low = 1 if max_nodes > 1 else 0  # the other nodes cannot find a port the OS picked
        if not _is_int(port) or not low <= port <= 65535:
            raise UsageError(f"--master-port must be a port number in {low}..65535, got {checks.shown(port)}")

    def range(self) -> tuple[int, int]:
        try:
            lo, _, hi = self.nnodes.partition(":")
            low, high = int(lo), int(hi or lo)
        except ValueError:
            low = high = 0
        if not 1 <= low <= high:
            raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {checks.shown(self.nnodes)}")
        return low, high

    def rendezvous(self) -> dict[str, Any]:
        """The elastic agent's rendezvous settings (endpoint, run id, this node's address)."""
        configs = dict(self.rdzv_conf)
        if self.range()[1] == 1:
            # Port 0 on loopback: the OS picks a free port when the store binds, so two jobs
            # never collide, and nothing listens beyond this machine.
            return {
                "rdzv_endpoint": "127.0.0.1:0",
                "rdzv_configs": {**configs, "is_host": True},
                "local_addr": "127.0.0.1",
                "run_id": f"ddpkit-{uuid.uuid4().hex[:12]}",
            }
        addr = self.master_addr or os.environ.get("MASTER_ADDR")
        if not addr:
            raise UsageError("--nnodes above 1 needs --master-addr: the address of the node that hosts the rendezvous")
        if self.node_rank is not None:
            configs.setdefault("is_host", self.node_rank == 0)  # an explicit --rdzv-conf is_host wins
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address in an endpoint
        return {
            "rdzv_endpoint": f"{host}:{self.master_port}",
            "rdzv_configs": configs,
            "run_id": self.run_id or f"ddpkit-{addr}-{self.master_port}",
            "local_addr": self.local_addr or route_address(addr, self.master_port),
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _conf_value(key: str, value: Any) -> Any:
    """A --rdzv-conf value as c10d reads it: a bool for is_host, a positive integer otherwise."""
    kind = RDZV_CONF.get(key)
    if kind is None:
        raise UsageError(f"--rdzv-conf {key}: not a setting of the c10d rendezvous (known: {', '.join(RDZV_CONF)})")
    text = str(value).strip().lower()
    if kind == "bool":
        if isinstance(value, bool) or text in _BOOLS:
            return value if isinstance(value, bool) else _BOOLS[text]
        raise UsageError(f"--rdzv-conf {key}={value}: expected true or false")
    if _is_int(value) or text.isdigit():
        number = int(text)
        if 1 <= number <= 2**31 - 1:
            return number
    what = "a whole number of seconds" if kind == "seconds" else "a whole number"
    raise UsageError(f"--rdzv-conf {key}={value}: expected {what} above 0")


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


# Far beyond the cores or GPUs of any one machine: a larger --nproc is a typo, and trying to
# start that many processes would take the machine down before anything reported it.
MAX_NPROC = 4096
# CPU processes per usable core beyond which a job is a mistake rather than a test of one
# (the test suite runs 3 processes on 2 cores).
CPU_OVERSUBSCRIPTION = 8


def parse_nproc(value: str | int, device_type: str) -> int:
    """`--nproc N` or `auto` (see `device.auto_nproc`); torchrun's `cpu` (one per usable core)
    and `gpu` (one per visible GPU) too."""
    if isinstance(value, int) or str(value).isdigit():
        n = int(value)
        if not 1 <= n <= MAX_NPROC:
            raise UsageError(f"--nproc must be a positive integer up to {MAX_NPROC}, auto, cpu or gpu, got {value}")
        if device_type == "cpu" and n > CPU_OVERSUBSCRIPTION * devices.cpu_count():
            raise UsageError(
                f"--nproc {n} is more than {CPU_OVERSUBSCRIPTION} processes per usable core "
                f"({devices.cpu_count()} here): each would get a sliver of a core"
            )
        return n
    if value == "auto":
        return devices.auto_nproc(device_type)
    if value == "cpu":
        return devices.cpu_count()
    if value == "gpu":
        if devices.gpu_count() < 1:
            raise UsageError("--nproc gpu: no GPU is visible")
        return devices.gpu_count()
    raise UsageError(f"--nproc must be a positive integer, auto, cpu or gpu, got {checks.shown(value)}")


@dataclass(frozen=True)
class Topology:
    """The processes of a job as this machine sees them.

    launcher: 'ddpkit' when ddpkit starts `nproc` workers here (through torch's elastic agent,
    or in this very process when there is one and nothing to restart or coordinate), or
    'torchrun' / 'slurm' when they exist already and this process is one of them.
    world_size: the job's size when it is known; with an elastic node range, its smallest.
    """

    device_type: str
    nproc: int
    nodes: Nodes = Nodes()
    max_restarts: int = 0
    launcher: str = "ddpkit"
    world_size: int = 1
    rendezvous: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def in_process(self) -> bool:
        """True when the work runs in this process: it is a torchrun/srun worker, or a single
        local process with nothing to restart and no other node to meet."""
        if self.launcher != "ddpkit":
            return True
        return self.nproc == 1 and self.max_restarts == 0 and self.nodes.range()[1] == 1


def local(device_type: str, nproc: str | int = "auto", nodes: Nodes = Nodes(), max_restarts: int = 0) -> Topology:
    """Workers that ddpkit starts on this machine (what `ddpkit.launch` and `ddpkit run` do)."""
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}")
    n = parse_nproc(nproc, device_type)
    return Topology(device_type, n, nodes, max_restarts, "ddpkit", n * nodes.range()[0], nodes.rendezvous())


def resolve(
    device: str,
    nproc: str | int = "auto",
    nodes: Nodes = Nodes(),
    max_restarts: int = 0,
    one_process: str | None = None,
) -> Topology:
    """The job's processes for a command's flags, checked against this machine and against a
    launcher that already started them. `one_process` names what forces a single process
    (for example '--strategy dp'), if anything."""
    device_type = devices.device_type(device)
    from ..core.dist import detect_env, job_problem  # imports torch: not while the flags are read

    env = detect_env()
    problem = job_problem(env)
    if problem:
        raise UsageError(problem)
    if env.source != "single":  # under torchrun / srun: this process is one worker
        _check_allocation(env, device_type, nproc, nodes, max_restarts)
        if one_process and env.world_size > 1:
            raise UsageError(
                f"{one_process} runs one process, but {env.source} started {env.world_size}; use --strategy ddp"
            )
        return Topology(device_type, 1, nodes, max_restarts, env.source, env.world_size)
    n = 1 if one_process and nproc == "auto" else parse_nproc(nproc, device_type)
    if one_process and n > 1:
        raise UsageError(f"{one_process} runs one process; drop --nproc {n} or use --strategy ddp")
    if device_type == "cuda" and n > devices.gpu_count():
        raise UsageError(f"--nproc {n} is more than the {devices.gpu_count()} visible GPUs")
    return local(device_type, n, nodes, max_restarts)


def _check_allocation(env: Any, device_type: str, nproc: str | int, nodes: Nodes, max_restarts: int) -> None:
    """Under srun or torchrun the processes already exist: flags asking for others are a
    mismatch, reported now rather than discovered as a hang at the first collective."""
    launcher = "srun" if env.source == "slurm" else "torchrun"
    if str(nproc) not in ("auto", "1") or nodes.nnodes != "1" or max_restarts:
        raise UsageError(
            f"under {launcher} each process is one worker ({env.world_size} in all): drop --nproc, "
            f"--nnodes and --max-restarts and size the job with {launcher}'s own options"
        )
    gpus = devices.gpu_count()
    if device_type == "cuda" and gpus > 1 and env.local_world_size > gpus:
        raise UsageError(
            f"{launcher} started {env.local_world_size} processes on this node but only {gpus} GPUs are visible"
        )
