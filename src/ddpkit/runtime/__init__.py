"""The Runtime (facade.py), the one object a user's own loop and `ddpkit train` hold, and what
it delegates to: backward and step (steps), full-state checkpoints (saves), loaders, the
collectives, gradient accumulation, exact evaluation and the gathers it uses, early stopping
and the EMA of the weights. Above the core, strategies, checkpoints, launcher and data; below
the products (trainer, tune, bench) and the command line.

`ddpkit.runtime` keeps what ddpkit 0.1's runtime module exported (`Runtime`, `DEVICES`,
`resolve_device`, `seed_everything`, `seed_rank`); its constants now in `saves` are said to have
moved.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .facade import DEVICES, Runtime, resolve_device, seed_everything, seed_rank

__all__ = ["DEVICES", "Runtime", "resolve_device", "seed_everything", "seed_rank"]

MOVED = {"PENDING_WAIT_S": "saves", "AUTOMATIC": "saves"}  # ddpkit 0.1's names, now in a module beside


def __getattr__(name: str) -> Any:
    if name in MOVED:
        new = f"{__name__}.{MOVED[name]}"
        warnings.warn(f"{__name__}.{name} is now {new}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
