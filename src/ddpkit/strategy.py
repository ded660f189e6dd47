"""How a model is spread over devices: `single`, `dp` (nn.DataParallel) or `ddp`.

Each strategy wraps a model for training and unwraps it for saving, so that DDP's `module.`
and torch.compile's `_orig_mod.` prefixes never reach a file.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from .precision import Precision

STRATEGIES = ("ddp", "dp", "single")


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under any DDP / DataParallel / autocast / torch.compile wrappers."""
    from .precision import AutocastModule

    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastModule)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def resolve(name: str, world_size: int, device: torch.device) -> str:
    """The strategy that will actually run: `ddp` on one process is `single`; `dp` needs GPUs."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if name == "ddp" and world_size == 1:
        return "single"
    if name == "single" and world_size > 1:
        raise ValueError(f"--strategy single on {world_size} processes would train {world_size} unsynchronized "
                         "copies; use --strategy ddp, or one process")
    if name == "dp":
        if world_size > 1:
            raise ValueError("--strategy dp runs in one process; use --nproc 1, or --strategy ddp")
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            return "single"  # DataParallel over one device (or a CPU) is the bare model plus overhead
    return name


def wrap(model: nn.Module, name: str, device: torch.device, precision: "Precision | None" = None) -> nn.Module:
    """Move `model` to `device` and wrap it for strategy `name` (already resolved), with the
    precision's autocast innermost so every replica runs it."""
    from .precision import AutocastModule

    model = model.to(device)
    if precision is not None and precision.name != "fp32":
        model = AutocastModule(model, precision)
    if name == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if name == "dp":
        warnings.warn(
            "nn.DataParallel runs one process and copies the model to every GPU each step; "
            "DistributedDataParallel (--strategy ddp) is faster on the same GPUs.",
            stacklevel=3,
        )
        return nn.DataParallel(model)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip DDP's gradient all-reduce inside the block (gradient accumulation); else no-op."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield
