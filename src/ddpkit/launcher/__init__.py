"""Starting workers: N local processes through torch's elastic launcher, on one machine or
several, and a failure reported by the rank that caused it.

- `topology`: where the processes run (device type, count, nodes), resolved before any starts;
- `elastic`: `launch` (a Python function on N workers) and `run_script` (`ddpkit run`);
- `workers`: fork or spawn, and what a forked worker undoes;
- `failures`: the root cause among the ranks that failed.
"""

from __future__ import annotations

from .elastic import launch, run_function, run_script
from .topology import Nodes, Topology, parse_nproc, route_address

__all__ = ["Nodes", "Topology", "launch", "parse_nproc", "route_address", "run_function", "run_script"]
