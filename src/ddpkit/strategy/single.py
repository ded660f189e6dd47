"""`single`: one process, one device, the bare model."""

from __future__ import annotations

import torch

from ..errors import UsageError
from .base import Strategy


class Single(Strategy):
    """The bare model on one device. `ddp` on one process and `dp` without two GPUs run so:
    their wrappers would add overhead and nothing else."""

    name = "single"
    one_process = True

    @classmethod
    def runs_as(cls, world_size: int, device: torch.device) -> str:
        if world_size > 1:
            raise UsageError(
                f"--strategy single on {world_size} processes would train {world_size} unsynchronized "
                "copies; use --strategy ddp, or one process"
            )
        return cls.name
