"""The Runtime (facade.py), the one object a user's own loop and `ddpkit train` hold, and what
it delegates to: gradient accumulation, exact evaluation and the gathers it uses, early
stopping and the EMA of the weights. Above the core, strategies, checkpoints, launcher and
data; below the products (trainer, tune, bench) and the command line."""

from .facade import Runtime

__all__ = ["Runtime"]
