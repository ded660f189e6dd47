"""`EarlyStopping`: stop when a monitored value has not improved for `patience` checks, with the
decision agreed by every rank.

A rank that leaves the training loop alone leaves the others waiting in its next collective
until the timeout (Lightning#379). Here each rank judges its own view of the value, then
`Runtime.any_rank` makes one decision for all: every rank stops when any of them would.

    stopper = ddpkit.EarlyStopping(patience=3)
    for epoch in range(epochs):
        train_one_epoch()
        if stopper.step(rt.evaluate(model, test_set)["loss"], rt):
            break
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core import checks
from ..errors import UsageError

if TYPE_CHECKING:
    from . import Runtime

MODES = ("min", "max")


@dataclass
class EarlyStopping:
    """Stop after `patience` checks in a row without an improvement of more than `min_delta`.

    Attributes:
        patience: checks without improvement after which to stop (at least 1).
        min_delta: how much better than the best so far a value must be to count as an
            improvement (0: any improvement).
        mode: 'min' (a loss: lower is better) or 'max' (an accuracy).
        best: the best value so far (inf or -inf before the first check).
        bad_checks: checks since the last improvement.
        stopped: the agreed decision: True once any rank said stop.
    """

    patience: int
    min_delta: float = 0.0
    mode: str = "min"
    best: float = field(default=math.nan, init=False)
    bad_checks: int = field(default=0, init=False)
    stopped: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.patience, bool) or not isinstance(self.patience, int):
            raise UsageError(f"EarlyStopping patience: a whole number of checks, not {checks.shown(self.patience)}")
        checks.positive("EarlyStopping patience", self.patience)
        checks.at_least("EarlyStopping min_delta", self.min_delta, 0)
        checks.choice("EarlyStopping mode", self.mode, MODES)
        self.best = math.inf if self.mode == "min" else -math.inf

    def improved(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than min_delta (NaN never does)."""
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def step(self, value: float, rt: Runtime | None = None) -> bool:
        """Record this check's `value`; returns True when training should stop. With `rt`, the
        decision is every rank's: True on all ranks if this rank's view or any other's says
        stop (one all-reduce: call it on every rank). Without, this process decides alone."""
        if self.improved(value):
            self.best, self.bad_checks = float(value), 0
        else:
            self.bad_checks += 1
        stop = self.stopped or self.bad_checks >= self.patience
        self.stopped = rt.any_rank(stop) if rt is not None else stop
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_checks": self.bad_checks, "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting from a saved state (a resumed run); a run that stopped stays stopped."""
        self.best = float(state["best"])
        self.bad_checks = int(state["bad_checks"])
        self.stopped = bool(state["stopped"])
