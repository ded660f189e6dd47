"""How a model is spread over devices: `single`, `dp` (nn.DataParallel) or `ddp`.

Each strategy wraps a model for training and unwraps it for saving, so that DDP's `module.`
and torch.compile's `_orig_mod.` prefixes never reach a file.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from .precision import Precision

STRATEGIES = ("ddp", "dp", "single")
COMM_HOOKS = ("none", "fp16", "bf16")


@dataclass(frozen=True)
class DDPOptions:
    """DistributedDataParallel's tuning knobs, as flags (`ddpkit bench comm` measures them).

    bucket_cap_mb: gradients are all-reduced in buckets of this size while backward still
        runs (torch's default 25); bigger buckets mean fewer, larger messages.
    gradient_as_bucket_view: gradients are views into the buckets: saves one copy of the
        gradients in memory and a copy per step.
    static_graph: the set of used parameters never changes between steps, so DDP can skip
        re-checking it (and overlap better); wrong for models with data-dependent branches.
    comm_hook: 'fp16' or 'bf16' all-reduces gradients compressed to 16 bits (half the bytes),
        decompressed before the optimizer step; 'none' all-reduces them as they are.
    """

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: str = "none"

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"--comm-hook: unknown value {self.comm_hook!r}; choose from {', '.join(COMM_HOOKS)}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gradient_as_bucket_view": self.gradient_as_bucket_view, "static_graph": self.static_graph}
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out


def comm_hook(name: str) -> Any:
    """The DDP communication hook for `name` (None for 'none')."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"none": None, "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]


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


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel wrapper inside `model` (under torch.compile), if any."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return None


def eval_view(model: nn.Module) -> nn.Module:
    """The model to evaluate with: without torch.compile (evaluation shapes would compile
    again) and without DDP (whose forward may broadcast buffers, a collective that ranks
    with different numbers of evaluation batches would not all reach). DataParallel and
    autocast stay."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
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


def wrap(model: nn.Module, name: str, device: torch.device, precision: "Precision | None" = None,
         ddp: DDPOptions = DDPOptions(), channels_last: bool = False, compile: bool | dict = False) -> nn.Module:
    """Move `model` to `device` and wrap it for strategy `name` (already resolved), with the
    precision's autocast innermost so every replica runs it, and torch.compile outermost (so
    that compiling sees DDP's buckets and keeps all-reduce overlapping the backward pass)."""
    from .precision import AutocastModule

    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if precision is not None and precision.name != "fp32":
        model = AutocastModule(model, precision)
    if name == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids, **ddp.kwargs())
        hook = comm_hook(ddp.comm_hook)
        if hook is not None:
            model.register_comm_hook(state=None, hook=hook)
    elif name == "dp":
        warnings.warn(
            "nn.DataParallel runs one process and copies the model to every GPU each step; "
            "DistributedDataParallel (--strategy ddp) is faster on the same GPUs.",
            stacklevel=3,
        )
        model = nn.DataParallel(model)
    if compile:
        model = torch.compile(model, **(compile if isinstance(compile, dict) else {}))
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip DDP's gradient all-reduce inside the block (gradient accumulation); else no-op."""
    ddp = find_ddp(model)
    if ddp is not None:
        with ddp.no_sync():
            yield
    else:
        yield
