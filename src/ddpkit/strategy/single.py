"""`single`: one process, one device, the bare model."""

from __future__ import annotations

from .base import Strategy


class Single(Strategy):
    """The bare model on one device. `ddp` on one process and `dp` without two GPUs run so:
    their wrappers would add overhead and nothing else."""

    name = "single"
    one_process = True
