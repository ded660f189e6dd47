"""`dp`: nn.DataParallel, one process driving every visible GPU."""

from __future__ import annotations

import warnings

from torch import nn

from .base import Strategy


class DataParallel(Strategy):
    """Replicates the model on every visible GPU each step, from one process. Kept because the
    tutorials start there; DDP is faster on the same GPUs, and says so once."""

    name = "dp"
    # DataParallel copies the module to every GPU each step; a compiled module's copies would
    # still call the original's compiled forward, on the first GPU. So compile around it.
    compile_inside = False

    def _wrap(self, model: nn.Module) -> nn.Module:
        warnings.warn(
            "nn.DataParallel runs one process and copies the model to every GPU each step; "
            "DistributedDataParallel (--strategy ddp) is faster on the same GPUs.",
            stacklevel=4,
        )
        return nn.DataParallel(model)
