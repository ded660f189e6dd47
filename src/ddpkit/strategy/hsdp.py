"""`hsdp`: hybrid sharding, FSDP2 on a 2-D mesh `replicate x dp`: the parameters, gradients and
optimizer state are sharded over the `dp` ranks of each replica and replicated across the
replicas. Gradients are reduce-scattered inside a replica, then all-reduced across replicas.

The use: one replica per machine (the default mesh: `replicate` = machines, `dp` = processes on
each), so that the all-gathers of every layer stay on the machine's fast links and only one
gradient all-reduce per step crosses machines. Everything else is fsdp's (see fsdp.py): the
same checkpoints (DCP directories that load on any layout), lockstep, meta builds.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .fsdp import FSDP
from .mesh import MeshSpec


class HSDP(FSDP):
    """FSDP2 sharded over `dp`, replicated over `replicate` (see the module docstring)."""

    name = "hsdp"
    mesh_dims: ClassVar[tuple[str, ...]] = ("replicate", "dp")
    own_dim: ClassVar[str | None] = "replicate"

    @classmethod
    def default_mesh(cls, world_size: int, local_world_size: int) -> MeshSpec:
        machines, local = MeshSpec.per_machine(world_size, local_world_size)
        return MeshSpec((("replicate", machines), ("dp", local)))

    @classmethod
    def needs_device_mesh(cls, spec: MeshSpec) -> bool:
        return True

    @classmethod
    def bytes_per_weight(cls, world_size: int) -> float:
        return 16.0  # the shares depend on the replica's size, not the job's: at most a whole copy

    def _shard_mesh(self) -> Any:
        assert self.layout is not None
        return self.layout.sub("replicate", "dp")
