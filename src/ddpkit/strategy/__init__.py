"""How a model is spread over devices, one module per strategy: `single` (the bare model),
`dp` (nn.DataParallel), `ddp` (DistributedDataParallel) and `fsdp` (FSDP2, sharded).

`resolve` turns a requested name into the strategy that will actually run on this many
processes: `ddp` or `fsdp` on one process is `single`; `dp` without two GPUs is `single` too.
"""

from __future__ import annotations

import torch

from .. import checks
from ..errors import UsageError
from .base import Strategy, compiled_graphs, eval_view, local, unwrap
from .ddp import (
    COMM_HOOKS,
    DDP,
    DDPOptions,
    DistributedDataParallel,
    comm_hook,
    find_ddp,
    no_sync,
    settled_backward,
    unsettled,
)
from .dp import DataParallel
from .fsdp import FSDP, FSDPOptions
from .single import Single

STRATEGIES = ("ddp", "dp", "fsdp", "single")

__all__ = [
    "COMM_HOOKS",
    "STRATEGIES",
    "DDPOptions",
    "DistributedDataParallel",
    "FSDPOptions",
    "Strategy",
    "comm_hook",
    "compiled_graphs",
    "eval_view",
    "find_ddp",
    "local",
    "no_sync",
    "resolve",
    "resolve_name",
    "settled_backward",
    "unsettled",
    "unwrap",
]


def resolve_name(name: str, world_size: int, device: torch.device) -> str:
    """The strategy that will actually run for `name` on `world_size` processes."""
    checks.choice("--strategy", name, STRATEGIES)
    if name in ("ddp", "fsdp") and world_size == 1:
        return "single"
    if name == "single" and world_size > 1:
        raise UsageError(
            f"--strategy single on {world_size} processes would train {world_size} unsynchronized "
            "copies; use --strategy ddp, or one process"
        )
    if name == "dp":
        if world_size > 1:
            raise UsageError("--strategy dp runs in one process; use --nproc 1, or --strategy ddp")
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            return "single"  # DataParallel over one device (or a CPU) is the bare model plus overhead
    return name


def resolve(
    name: str,
    world_size: int,
    device: torch.device,
    ddp: DDPOptions = DDPOptions(),
    fsdp: FSDPOptions = FSDPOptions(),
) -> Strategy:
    """The `Strategy` object that runs `name` here (see `resolve_name`)."""
    actual = resolve_name(name, world_size, device)
    if actual == "ddp":
        return DDP(device, ddp)
    if actual == "fsdp":
        return FSDP(device, fsdp)
    return DataParallel(device) if actual == "dp" else Single(device)
