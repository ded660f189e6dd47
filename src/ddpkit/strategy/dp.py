"""`dp`: nn.DataParallel, one process driving every visible GPU."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import UsageError
from .base import Strategy


class DataParallel(Strategy):
    """Replicates the model on every visible GPU each step, from one process. Kept because the
    tutorials start there; DDP is faster on the same GPUs, and says so once."""

    name = "dp"
    # DataParallel copies the module to every GPU each step; a compiled module's copies would
    # still call the original's compiled forward, on the first GPU. So compile around it.
    compile_inside = False
    one_process = True
    keeps_torch_dropout = True

    @classmethod
    def runs_as(cls, world_size: int, device: torch.device) -> str:
        if world_size > 1:
            raise UsageError("--strategy dp runs in one process; use --nproc 1, or --strategy ddp")
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            return "single"  # DataParallel over one device (or a CPU) is the bare model plus overhead
        return cls.name

    def devices(self, world_size: int) -> int:
        return torch.cuda.device_count()

    def _wrap(self, model: nn.Module) -> nn.Module:
        warnings.warn(
            "nn.DataParallel runs one process and copies the model to every GPU each step; "
            "DistributedDataParallel (--strategy ddp) is faster on the same GPUs.",
            stacklevel=4,
        )
        return nn.DataParallel(model)
