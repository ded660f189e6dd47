"""The layout of a job's processes: `--mesh dp=2,tp=2`, `Runtime(mesh="dp=2,tp=2")`.

A mesh names each dimension and its size; the product of the sizes is the number of
processes. The dimensions, outermost first:

- `pp`: pipeline parallel: the ranks along it hold consecutive stages of the model and read
  the same samples (`--strategy pp`);
- `replicate`: whole copies of the model, each sharded over `dp` (HSDP, `--strategy hsdp`);
- `dp`: data parallel: each rank along it reads other samples (ddp replicates the model over
  it, fsdp, hsdp and tp shard it);
- `tp`: tensor parallel: the ranks along it split each layer's weights and read the same
  samples (`--strategy tp`).

Ranks along the innermost dimension are neighbours (rank r and r + 1), so on a machine of 8
GPUs `dp=2,tp=4` keeps each tensor-parallel group, which talks at every layer, inside one
machine, as torch's `init_device_mesh` lays it out. The mesh is torch's `DeviceMesh`; this
module parses and checks it and says where a rank sits on it.

Which samples a rank reads depends only on its place along the data dimensions (`replicate`
and `dp`): every rank of one tensor-parallel group reads the same micro-batches, and the global
batch, token weighting and exact evaluation are those of `replicate x dp` data ranks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core import dist
from ..errors import UsageError

# Outermost first (torch's DeviceMesh is row-major: the last dimension's ranks are neighbours).
DIMS = ("pp", "replicate", "dp", "tp")
# Those along which ranks read other samples.
DATA_DIMS = ("replicate", "dp")
_ITEM = re.compile(r"^\s*([a-z]+)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class MeshSpec:
    """Named sizes, in `DIMS` order (a dimension not named has size 1)."""

    sizes: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, value: str | Mapping[str, int] | MeshSpec, what: str = "--mesh") -> MeshSpec:
        """`"dp=2,tp=2"` or `{"dp": 2, "tp": 2}`; a UsageError names what is wrong."""
        if isinstance(value, MeshSpec):
            return value
        if isinstance(value, str):
            items: list[tuple[str, Any]] = []
            for part in value.split(","):
                match = _ITEM.match(part)
                if not match:
                    raise UsageError(
                        f"{what} {value!r}: expected name=size pairs separated by commas, e.g. dp=2,tp=2 "
                        f"(names: {', '.join(DIMS)})"
                    )
                items.append((match.group(1), int(match.group(2))))
        elif isinstance(value, Mapping):
            items = list(value.items())
        else:
            raise UsageError(
                f"{what}: expected a string like 'dp=2,tp=2' or a dict of sizes, got {type(value).__name__}"
            )
        sizes: dict[str, int] = {}
        for name, size in items:
            if name not in DIMS:
                raise UsageError(f"{what}: unknown dimension {name!r} (names: {', '.join(DIMS)})")
            if name in sizes:
                raise UsageError(f"{what}: {name} is named twice")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UsageError(f"{what}: {name}={size!r} (a size is a whole number of processes, at least 1)")
            sizes[name] = size
        if not sizes:
            raise UsageError(f"{what}: no dimension given (e.g. dp=2,tp=2)")
        return cls(tuple((name, sizes[name]) for name in DIMS if name in sizes))

    def size(self, dim: str) -> int:
        return dict(self.sizes).get(dim, 1)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sizes)

    @property
    def processes(self) -> int:
        return math.prod(size for _, size in self.sizes)

    @property
    def data_size(self) -> int:
        """How many ranks read other samples: the product of the data dimensions."""
        return math.prod(self.size(dim) for dim in DATA_DIMS)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.sizes)

    def check_processes(self, world_size: int, what: str = "--mesh") -> None:
        if self.processes != world_size:
            start = f"--nproc {self.processes}" if what == "--mesh" else f"{self.processes} processes"
            raise UsageError(
                f"{what} {self}: its sizes multiply to {self.processes} processes, but the job has {world_size} "
                f"({start}, or a mesh of {world_size})"
            )

    def grid(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """torch's `init_device_mesh` shape and dimension names: every mesh has a dp dimension
        (of size 1 where none was named), whose group is the data ranks' where tensor-parallel
        ranks share their samples."""
        dims = [(name, self.size(name)) for name in DIMS if name in self.names or name == "dp"]
        return tuple(size for _, size in dims), tuple(name for name, _ in dims)

    @staticmethod
    def per_machine(world_size: int, local_world_size: int) -> tuple[int, int]:
        """(machines, processes on each) for a default two-level mesh: one group per machine,
        or groups of one process where the machines do not split the job evenly."""
        local = local_world_size if 0 < local_world_size <= world_size and world_size % local_world_size == 0 else 1
        return world_size // local, local

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits along each dimension (row-major, as DeviceMesh lays it out)."""
        out: dict[str, int] = {}
        for name, size in reversed(self.sizes):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name, _ in self.sizes}

    def data_rank(self, rank: int) -> int:
        """Which of the `data_size` data ranks global `rank` is (its place along replicate x dp)."""
        at = self.coordinates(rank)
        return at.get("replicate", 0) * self.size("dp") + at.get("dp", 0)


@dataclass
class Layout:
    """A rank's place in a running job: the mesh, torch's DeviceMesh over it (None on one
    process, or where no strategy needs one), and the group of ranks that read other samples
    (None: every rank does)."""

    spec: MeshSpec
    device_mesh: Any = None
    data_group: Any = None

    @classmethod
    def plain(cls, world_size: int) -> Layout:
        """Every rank reads other samples: `dp=world_size`, no DeviceMesh."""
        return cls(MeshSpec((("dp", world_size),)))

    @classmethod
    def build(cls, spec: MeshSpec, device: torch.device) -> Layout:
        """torch's DeviceMesh over the job's processes (collective: every rank builds it), and
        the group of data ranks where some ranks share their samples."""
        from torch.distributed.device_mesh import init_device_mesh  # torch.distributed.tensor: 0.5 s

        seen = sorted(set(dist.gather_objects(str(spec))))
        if len(seen) > 1:  # default meshes on machines of different process counts, say
            raise UsageError(
                f"the ranks do not agree on the mesh ({' / '.join(seen)}): give every rank the same --mesh"
            )
        shape, names = spec.grid()
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        group = None
        if spec.data_size != spec.processes:
            data = tuple(name for name in DATA_DIMS if name in mesh.mesh_dim_names)
            group = (mesh[data]._flatten("data") if len(data) > 1 else mesh[data[0]]).get_group()
        return cls(spec, mesh, group)

    @property
    def data_size(self) -> int:
        return self.spec.data_size

    def data_rank(self, rank: int) -> int:
        return self.spec.data_rank(rank)

    def leads(self, rank: int) -> bool:
        """Whether global `rank` is the one of the ranks that read its samples whose sums count,
        where every rank's are gathered: tp coordinate 0, and the last pipeline stage (the one
        that computes the loss)."""
        last = {"pp": self.spec.size("pp") - 1}
        return all(at == last.get(name, 0) for name, at in self.spec.coordinates(rank).items() if name not in DATA_DIMS)

    def where(self, rank: int) -> str:
        """`dp=1,tp=0`: the rank's coordinates, for messages (empty on a plain layout)."""
        if self.spec.names == ("dp",):
            return ""
        return ",".join(f"{name}={at}" for name, at in self.spec.coordinates(rank).items())

    def sub(self, *dims: str) -> Any:
        """The DeviceMesh over `dims` (those of them this mesh has), or None."""
        if self.device_mesh is None:
            return None
        have = tuple(d for d in dims if d in self.device_mesh.mesh_dim_names)
        if not have:
            return None
        return self.device_mesh[have] if len(have) > 1 else self.device_mesh[have[0]]
