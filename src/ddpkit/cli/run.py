"""`ddpkit run SCRIPT`: a script written for torchrun (or ddpkit.Runtime) on N processes."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from ..errors import UsageError
from .parsing import ArgumentParser


def main(argv: Sequence[str]) -> int:
    a = _parser().parse_args(argv)
    if not a.module and not os.path.isfile(a.script):
        raise UsageError(f"script {a.script}: no such file")
    from ..launcher import Nodes, run_script

    nodes = Nodes(a.nnodes, a.node_rank, a.master_addr, a.master_port, a.run_id)
    run_script(
        a.script,
        a.args,
        nproc=a.nproc,
        max_restarts=a.max_restarts,
        nodes=nodes,
        output="rank0" if a.rank0_only else "prefixed",
        module=a.module,
    )
    return 0


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="ddpkit run",
        description="Run a script written for torchrun (or ddpkit.Runtime) on N "
        "processes per node through torch's elastic agent. On one machine the rendezvous port is "
        "picked by the OS on the loopback address; on several, every node runs the same command.",
    )
    p.add_argument(
        "--nproc", default="auto", help="processes on this node: N, or auto (one per GPU; on CPU one per 4 cores)"
    )
    p.add_argument("--nnodes", default="1", help="number of nodes, N or MIN:MAX (default 1)")
    p.add_argument("--node-rank", type=int, help="0 on the node that hosts the rendezvous (optional)")
    p.add_argument("--master-addr", help="address of the rendezvous host (needed when --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on that host (default 29500)")
    p.add_argument("--run-id", help="job id, the same on every node (default derived from address and port)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to N times when one dies")
    p.add_argument("--rank0-only", action="store_true", help="show local rank 0's output only (others: logs)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    return p
