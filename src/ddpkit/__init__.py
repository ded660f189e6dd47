"""ddpkit: PyTorch training on one CPU, one GPU, all GPUs of a machine or many machines, with the
number of processes as a launch flag and results that do not depend on it.

    import ddpkit
    ddpkit.launch(main, nproc=2)          # main() builds a ddpkit.Runtime inside each worker

Heavy imports (torch) happen on first use of `Runtime` / `launch`, so `import ddpkit` is cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EMA",
    "Dropout",
    "EarlyStopping",
    "Runtime",
    "dropout",
    "launch",
    "UsageError",
    "WorkerFailed",
    "__version__",
]

from . import threads as _threads  # noqa: F401 - its load reading starts at `import ddpkit`
from .errors import UsageError, WorkerFailed
from .version import __version__


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name == "EMA":
        from .ema import EMA

        return EMA
    if name == "EarlyStopping":
        from .early_stopping import EarlyStopping

        return EarlyStopping
    if name in ("Dropout", "dropout"):
        from . import draws

        return getattr(draws, name)
    if name == "launch":
        from .launcher import launch

        return launch
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
