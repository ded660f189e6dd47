"""Where a Runtime is among the job's processes, and its collectives: the rank facts, rank-0
printing, barriers and `main_first`, reductions, gathers and broadcasts, through `core.dist`
(which also works without a process group, as one process). A part of `Runtime`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..core import dist
from ..core.log import print0


class Collectives:
    """The Runtime's rank facts and collectives (its `env`, `device` and `layout` are the
    Runtime's)."""

    layout: Any

    @property
    def rank(self) -> int:
        """This process's global rank (0 without a process group)."""
        return dist.rank()

    @property
    def world_size(self) -> int:
        """The number of processes in the job (1 without a process group)."""
        return dist.world_size()

    @property
    def data_rank(self) -> int:
        """Which of the data ranks this process is: its place along the mesh's data dimensions
        (replicate x dp). The global rank, unless tensor-parallel ranks share their samples."""
        return self.layout.data_rank(self.rank)

    @property
    def data_world_size(self) -> int:
        """How many ranks read other samples (the world size, unless tensor-parallel ranks
        share theirs): what the global batch is split over."""
        return self.layout.data_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine: the GPU it binds to."""
        return self.env.local_rank

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that prints and writes files."""
        return dist.is_main()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only."""
        print0(*args, **kwargs)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        dist.barrier()

    @contextlib.contextmanager
    def main_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on rank 0 first (with `local`, on each machine's local rank 0), then
        on the other ranks: download or preprocess once, then read what it left.

            with rt.main_first():
                data = load_or_download(path)

        The others wait as long as for checkpoint writes, so a slow download does not trip
        `timeout_s`. If the block fails on rank 0, the others still run it (rank 0's error is
        what the launch reports)."""
        first = self.local_rank == 0 if local else self.is_main
        if not first:
            dist.wait_for_main(local)
        try:
            yield
        finally:
            if first:
                dist.wait_for_main(local)

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Reduce a tensor (in place) or a Python number over the data ranks; op
        sum/mean/max/min. The data ranks are every rank, unless tensor-parallel ranks share
        their samples: then each group's copy counts once, so a sum of sample counts or losses
        is the global batch's. (`gather_objects`, `all_gather`, `any_rank` and `barrier` are
        over every rank: facts of each process.)"""
        group = self.layout.data_group
        if isinstance(value, torch.Tensor):
            return dist.all_reduce(value, op, group)
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        return dist.all_reduce(t, op, group).item()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank: a decision all ranks act on
        together (stop, skip), so none leaves a loop the others stay in and waits forever.
        One all-reduce over every rank; every rank must call it."""
        t = torch.tensor(float(bool(flag)), dtype=torch.float64, device=self.device)
        return dist.all_reduce(t, "max").item() > 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (sizes may differ per rank), in rank order."""
        return dist.all_gather(tensor)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable object, on every rank."""
        return dist.broadcast_object(obj, src)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order, on every rank."""
        return dist.gather_objects(obj)
