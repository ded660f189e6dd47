"""`ddpkit plan`: will a job fit, and how fast will it run, on a cluster not booked yet.

`plan(spec, cluster)` traces one training step of every layout ddpkit can run there on fake
tensors over a fake process group of the cluster's size (`trace`), predicts each one's step
time from its FLOPs and collectives (`predict`), and recommends the fastest that fits, with the
`ddpkit train` command that runs it. `output` prints the table, writes the JSON and the plot.
"""

from __future__ import annotations

from .cluster import GPUS, Cluster, cluster
from .run import Plan, Spec, plan

__all__ = ["GPUS", "Cluster", "Plan", "Spec", "cluster", "plan"]
