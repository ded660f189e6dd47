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
from dataclasses import dataclass, field
from typing import Any

from .. import device as devices
from ..errors import UsageError


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

    def rendezvous(self) -> dict[str, Any]:
        """The elastic agent's rendezvous settings (endpoint, run id, this node's address)."""
        if self.range()[1] == 1:
            # Port 0 on loopback: the OS picks a free port when the store binds, so two jobs
            # never collide, and nothing listens beyond this machine.
            return {
                "rdzv_endpoint": "127.0.0.1:0",
                "rdzv_configs": {"is_host": True},
                "local_addr": "127.0.0.1",
                "run_id": f"ddpkit-{uuid.uuid4().hex[:12]}",
            }
        addr = self.master_addr or os.environ.get("MASTER_ADDR")
        if not addr:
            raise UsageError("--nnodes above 1 needs --master-addr: the address of the node that hosts the rendezvous")
        configs = {} if self.node_rank is None else {"is_host": self.node_rank == 0}
        return {
            "rdzv_endpoint": f"{addr}:{self.master_port}",
            "rdzv_configs": configs,
            "run_id": self.run_id or f"ddpkit-{addr}-{self.master_port}",
            "local_addr": route_address(addr, self.master_port),
        }


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


def parse_nproc(value: str | int, device_type: str) -> int:
    """`--nproc N` or `auto` (see `device.auto_nproc`)."""
    if isinstance(value, int) or str(value).isdigit():
        n = int(value)
        if n < 1:
            raise UsageError(f"--nproc must be a positive integer or 'auto', got {value}")
        return n
    if value == "auto":
        return devices.auto_nproc(device_type)
    raise UsageError(f"--nproc must be a positive integer or 'auto', got {value!r}")


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
    from ..dist import detect_env

    env = detect_env()
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
