"""`ddpkit train`: a built-in model on a built-in dataset, the product on top of `Runtime`.

- `config`: `TrainConfig` (the flags), recipes, YAML layering;
- `plan`: `make_plan(cfg) -> RunPlan`, every check and derived value, once;
- `loop`: `train(cfg)` and the worker's `fit(plan)`;
- `resume`: which checkpoint a run continues from, and the run state a checkpoint holds;
- `outputs`: everything under `--out`.
"""

from __future__ import annotations

from .config import TrainConfig
from .loop import fit, train
from .plan import RunPlan, make_plan, resolve

__all__ = ["RunPlan", "TrainConfig", "fit", "make_plan", "resolve", "train"]
