"""What every strategy shares: the wrapping order, and seeing through wrappers.

`Strategy.wrap` moves a model to its device and wraps it: channels-last layout, then the
precision's autocast innermost (so every DataParallel replica runs it), then the strategy's own
wrapper, then torch.compile outermost (so compiling sees DDP's buckets and keeps all-reduce
overlapping the backward pass). `unwrap` takes them all off again, so DDP's `module.` and
torch.compile's `_orig_mod.` prefixes never reach a file.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from ..precision import Precision


class Strategy:
    """One process, one device, the bare model (also what `ddp` runs on a single process)."""

    name: ClassVar[str] = "single"

    def __init__(self, device: torch.device):
        self.device = device

    def wrap(
        self,
        model: nn.Module,
        precision: Precision | None = None,
        channels_last: bool = False,
        compile: bool | dict = False,
    ) -> nn.Module:
        from ..precision import AutocastModule

        model = model.to(self.device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if precision is not None and precision.name != "fp32":
            model = AutocastModule(model, precision)
        model = self._wrap(model)
        if compile:
            model = torch.compile(model, **(compile if isinstance(compile, dict) else {}))
        return model

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients of `optimizer`'s parameters so that their total 2-norm is at most
        `max_norm`; returns the norm before clipping. (Replicated gradients are whole on every
        rank; a sharded strategy must reduce the norm over its shards instead.)"""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def no_sync(self, model: nn.Module) -> Callable[[], AbstractContextManager[Any]] | None:
        """What makes a context that skips the gradient reduction of the backward passes inside
        it (all but the last micro-batch of a step), or None where nothing is reduced."""
        return None


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under any DDP / DataParallel / autocast / torch.compile wrappers."""
    from ..precision import AutocastModule

    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastModule)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


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
