"""Gradient accumulation over micro-batches, so the optimizer sees the mean over the whole
global batch however it was split over ranks and micro-batches.

A rank's micro-batch of n samples, out of a global batch of B, counts n * world_size / B in
the backward pass (the strategy's gradient reduction then averages over the ranks). When the
loss is a mean over tokens (the dataset has `token_counts`: sequences of varying length), a
micro-batch of t tokens, out of T in the global batch, counts t * world_size / T instead: the
optimizer then sees the mean over every token of the global batch, as one process would,
however unevenly the tokens fall on ranks and micro-batches. The
reduction itself runs only on a rank's last micro-batch of a step: the strategy's `no_sync`
is entered as the loader hands out any earlier one. It must already be on during the forward
pass, not only around backward, because DDP arms its all-reduce in the forward. Ranks may so
run different numbers of micro-batches; each still reduces exactly once per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core import checks, dist
from ..data import DistributedLoader, MicroBatch
from ..errors import UsageError
from ..strategy import local


class Accumulation:
    """The micro-batch a training loader handed out last, and the gradient-sync switch."""

    def __init__(self, world_size: int, group: Any = None):
        self.world_size = world_size  # the data ranks' (see ddpkit.strategy.mesh)
        self.group = group  # theirs (None: every rank)
        self.micro: MicroBatch | None = None
        self.loader: DistributedLoader | None = None  # the one that handed it out
        self.no_sync: Any = None  # makes the strategy's no_sync context (Strategy.no_sync)
        self._entered: Any = None
        # Weights given to backward(loss, weight=...) this step, summed on the device (no sync);
        # `weighted` while the gradients they weighted wait for `rescale`. `by_weight` stays on
        # from the first weighted backward: every later one must be weighted too, or the ranks'
        # rescale all-reduces would not pair up.
        self.weights: torch.Tensor | None = None
        self.weighted = self.by_weight = False
        # The current micro-batch's backward is the loss as given: nothing to weigh (a weight of
        # exactly 1, or no loader's batch), no no_sync to leave, no weighted backward before. Kept
        # up to date here so that Runtime.backward checks one flag per step (see its fast path).
        self.as_given = True
        self._seen, self._seen_unit = None, True  # the last MicroBatch on_batch weighed, and whether it counts 1
        # Runtime.backward has a first backward of its own to run (DDP's buckets to settle: see
        # strategy.settled_backward): not the loss as given until then.
        self.hold = False

    @property
    def step_ready(self) -> bool:
        """True when the gradients of a whole global batch are in (or batches are not ours)."""
        return self.micro is None or self.micro.last

    def on_batch(self, loader: DistributedLoader) -> None:
        """Told by a training loader of every micro-batch it hands out, before the user's
        forward, and when a pass ends or is left (then `loader.current` is None)."""
        if self._entered is not None:
            self.leave()
        self.loader = loader
        micro = self.micro = loader.current
        if micro is not None and not micro.last and self.no_sync is not None:
            self._entered = self.no_sync()
            self._entered.__enter__()
        if micro is not self._seen:  # a loader's full global batches share one MicroBatch: weighed once
            self._seen, self._seen_unit = micro, micro is None or unit_weight(micro, self.world_size)
        self.as_given = self._seen_unit and self._entered is None and not self.by_weight and not self.hold

    def set_hold(self, hold: bool) -> None:
        self.hold = hold
        self.as_given = self._seen_unit and self._entered is None and not self.by_weight and not hold

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate for the current micro-batch (the mean loss as given when
        the batch is not one of a loader's)."""
        if self.by_weight:
            raise UsageError(
                "rt.backward(loss) without weight= after weighted ones: once one backward is weighted, "
                "give a weight in every backward on every rank (0 for an empty share)"
            )
        micro = self.micro
        if micro is None:
            return loss
        if micro.count == 0:  # an empty share (or no real token): zero gradients, but the reduction still runs
            return loss.nan_to_num(0.0) * 0.0
        weight = share(micro, self.world_size)
        # even shares, no accumulation: the hand-written loop's backward exactly
        return loss * weight if weight != 1.0 else loss

    def weigh_by(self, loss: torch.Tensor, weight: Any) -> torch.Tensor:
        """The loss to back-propagate when the caller says what its mean is over (`weight`
        tokens, say): the sum `loss * weight`, whose gradients `rescale` divides by the step's
        total weight over all ranks once it is known."""
        w = checked_weight(weight, loss.device)
        self.weights = w.clone() if self.weights is None else self.weights + w
        self.weighted = self.by_weight = True
        self.as_given = False
        # An empty share (weight 0) may have a NaN mean: zero gradients, but the reduction still runs.
        return torch.where(w > 0, loss * w.to(loss.dtype), loss.nan_to_num(0.0) * 0.0)

    def rescale(self, params: list[torch.Tensor]) -> None:
        """Divide the step's gradients by its total weight over all ranks (times the world size,
        which the strategy's gradient averaging divides by): one scalar all-reduce per step.
        Collective, on every rank, after weighted backward passes; once per step (a second
        optimizer stepped on the same gradients finds them rescaled already)."""
        if not self.weighted:
            return
        self.weighted = False
        total = dist.all_reduce(self.weights, group=self.group)
        factor = torch.where(total > 0, self.world_size / total, torch.zeros_like(total))
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)  # a 0-d float64 tensor: no sync, any grad dtype
        self.weights = None

    def leave(self) -> None:
        """Turn gradient sync back on (after a backward, or when a pass ends)."""
        if self._entered is not None:
            self._entered.__exit__(None, None, None)
            self._entered = None


def share(micro: MicroBatch, world_size: int) -> float:
    """What `micro`'s mean loss counts in the step: its samples or tokens over the global
    batch's, times the data ranks (whose gradients the strategy averages); 0 when it has none."""
    return micro.count * world_size / micro.step_count if micro.count else 0.0


def unit_weight(micro: MicroBatch, world_size: int) -> bool:
    """Whether `micro` counts exactly 1 (`weigh` returns the loss as given): a whole global batch
    of one process, or an even share of one on each rank, with no micro-batches."""
    count = micro.count
    return count > 0 and count * world_size == micro.step_count


def checked_weight(weight: Any, device: torch.device) -> torch.Tensor:
    """`weight` as a 0-d float64 tensor on `device`, detached. A number must be finite and not
    negative (a UsageError here, no sync); a tensor must hold one value (its value is not read:
    that would wait for the device)."""
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise UsageError(f"rt.backward(weight=...): one number, not a tensor of shape {tuple(weight.shape)}")
        return weight.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise UsageError(
            f"rt.backward(weight=...): a count of tokens or samples (a number >= 0), not {checks.shown(weight)}"
        )
    return torch.tensor(float(weight), dtype=torch.float64, device=device)
