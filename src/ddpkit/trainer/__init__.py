"""`ddpkit train`: a built-in model on a built-in dataset, the product on top of `Runtime`.

- `config`: `TrainConfig` (the flags), recipes, YAML layering;
- `plan`: `make_plan(cfg) -> RunPlan`, every check and derived value, once;
- `loop`: `train(cfg)` and the worker's `fit(plan)`;
- `resume`: which checkpoint a run continues from, and the run state a checkpoint holds;
- `outputs`: everything under `--out`.

`config` loads no torch, and this package loads the others only when one of their names is
asked for: `ddpkit train --help` and a bad flag answer without importing torch (3 s).
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import TrainConfig

_LAZY = {"fit": "loop", "train": "loop", "RunPlan": "plan", "make_plan": "plan", "resolve": "plan"}

__all__ = ["RunPlan", "TrainConfig", "fit", "make_plan", "resolve", "train"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
