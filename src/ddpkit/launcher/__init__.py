"""Starting workers: N local processes through torch's elastic launcher, on one machine or
several, and a failure reported by the rank that caused it.

- `topology`: where the processes run (device type, count, nodes), resolved before any starts;
- `elastic`: `launch` (a Python function on N workers) and `run_script` (`ddpkit run`);
- `store`: the rendezvous, torch's c10d plus the workers' port held each round;
- `workers`: fork or spawn, and what a forked worker undoes;
- `records`: what each worker leaves behind (pid, stack dump, exit status);
- `failures`: the root cause among the ranks that failed, and why a restart happened;
- `script`: what each `ddpkit run` worker runs the user's script in.
"""

from __future__ import annotations

from .elastic import launch, run_function, run_script
from .failures import restart_note
from .topology import Nodes, Topology, parse_nproc, route_address

__all__ = ["Nodes", "Topology", "launch", "parse_nproc", "restart_note", "route_address", "run_function", "run_script"]
