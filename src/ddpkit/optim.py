"""The optimizers `ddpkit train` and `ddpkit find-batch-size` build, and the learning-rate
schedule of `ddpkit train`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

OPTIMIZERS = ("sgd", "adamw")


def build_optimizer(
    name: str, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """'sgd' (Nesterov when momentum > 0; momentum 0 is plain SGD, as in d2l and the DDP
    tutorials) or 'adamw'."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0, weight_decay=weight_decay)


def warmup_cosine(total_steps: int, warmup_steps: int, start: float = 0.0) -> Callable[[int], float]:
    """LR factor per optimizer step: linear from `start` to 1 over `warmup_steps`, then cosine
    to zero at `total_steps`. Depends on steps, not processes, like everything else in a run."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return start + (1.0 - start) * step / warmup_steps
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)))

    return factor
