"""What `rt.backward` and `rt.step` do, and the count of optimizer steps taken.

The hand-written loop's `loss.backward()`, `optimizer.step()` and `zero_grad()` are the fast
path: taken whenever there is nothing to weigh, scale, clip, check or settle, worked out once
(`replan`) from what changes only at setup() or after the first compiled step, so a step reads
one flag. Otherwise the micro-batch's loss is weighted for the global batch (`Accumulation`),
the strategy runs its own backward where it has one (ddp settling its buckets), and the step
checks the optimizer, rescales weighted gradients, clips over every shard and steps through
the precision's GradScaler.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from ..core.log import print0
from ..core.precision import Precision
from ..strategy import Strategy, compiled_graphs
from .accumulation import Accumulation


class Steps:
    """One Runtime's backward and step. `count`: the optimizer steps taken (a second optimizer
    stepped on the same backward is the same step), which keys the dropout masks, seeds fresh
    random streams on a resume onto another world size, and says which log records a resumed
    run keeps. `models` and `optimizers`: everything given to setup(), the Runtime's own lists."""

    def __init__(
        self,
        strategy: Strategy,
        precision: Precision,
        acc: Accumulation,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        self.strategy, self.precision, self.acc = strategy, precision, acc
        self.models, self.optimizers = models, optimizers
        self.count, self.counted = 0, False
        self.check_compiled = False  # from setup() with compile until the first step
        self.plain = False  # step() is opt.step() and zero_grad alone (see replan)
        self.replan()

    def adopt(self, wrapped: nn.Module, world_size: int, compiled: bool) -> None:
        """After setup() wrapped a model: the sync switch between micro-batches, and whether the
        strategy's own first backward runs (not with several models, whose backward reduces
        which model's buckets is not known, nor under torch.compile, whose compiled backward may
        refuse a retained graph)."""
        self.check_compiled = compiled
        self.replan()
        self.acc.no_sync = self.strategy.no_sync(wrapped)
        if len(self.models) == 1 and not compiled:
            self.acc.set_hold(self.strategy.arm(wrapped, world_size))
        else:
            self.strategy.disarm()
            self.acc.set_hold(False)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None) -> None:
        acc = self.acc
        if weight is None and acc.as_given and self.precision.scaler is None:
            loss.backward()  # the hand-written loop's backward exactly: nothing to weigh, scale or leave
        else:
            try:
                weighted = acc.weigh(loss) if weight is None else acc.weigh_by(loss, weight)
                if acc.hold:  # the strategy has a backward of its own to run (ddp: settling)
                    if not self.strategy.backward(weighted, functools.partial(self.precision.backward, weighted)):
                        acc.set_hold(False)
                else:
                    self.precision.backward(weighted)
            finally:
                acc.leave()
        self.counted = False

    def ran_backward(self) -> None:
        """A backward ran outside `backward` (a pipeline's schedule): the next step() counts."""
        self.counted = False

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> bool:
        acc = self.acc
        micro = acc.micro
        if micro is not None and not micro.last:  # not step_ready (read here: step() runs every step)
            return False
        if self.plain and max_grad_norm is None and not acc.weighted:
            optimizer.step()  # the hand-written loop's step exactly
            optimizer.zero_grad(set_to_none=True)
        else:
            self._step(optimizer, max_grad_norm)
        if not self.counted:  # a second optimizer stepped on the same backward is the same step
            self.count, self.counted = self.count + 1, True
        return True

    def replan(self) -> None:
        """Whether step() may be the optimizer's step and zero_grad alone, when no weighted
        backward and no clipping asks for more: worked out once from what changes only here
        (the strategy, the scaler, setup()'s compile check), so step() reads one flag."""
        checks = self.strategy.checks_optimizers or self.precision.scaler is not None
        self.plain = not (checks or self.check_compiled)

    def _step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
        """step()'s work when it is more than the optimizer's step and zero_grad."""
        if self.strategy.checks_optimizers:
            self.strategy.check_optimizer(optimizer)
        if self.acc.weighted:  # only then: listing the parameters costs time on every step
            self.acc.rescale(self._parameters(optimizer))
        if max_grad_norm is not None:
            self.precision.unscale(optimizer)
            self.strategy.clip_grad_norm(optimizer, max_grad_norm)
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if self.check_compiled:
            self._warn_if_nothing_compiled()

    def _parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Every parameter a step may update: of every model and optimizer given to setup() and
        of `optimizer`, each once (what a weighted step's gradients are rescaled over)."""
        groups = [m.parameters() for m in self.models]
        groups += [(p for g in opt.param_groups for p in g["params"]) for opt in (*self.optimizers, optimizer)]
        return list({id(p): p for group in groups for p in group}.values())

    def _warn_if_nothing_compiled(self) -> None:
        """After the first step with compile: one line on rank 0 if this process has no compiled
        graph at all (the model then runs as it would uncompiled, plus dynamo's overhead). Not
        a count of this model's graphs: a model like one compiled before reuses its graph."""
        self.check_compiled = False
        self.replan()
        if compiled_graphs() == 0:
            print0(
                "ddpkit: warning: torch.compile produced no graph in the first step: the model runs "
                "uncompiled (TORCH_LOGS=graph_breaks shows why)",
                file=sys.stderr,
            )
