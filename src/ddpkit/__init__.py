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

from . import _moved
from .core import threads as _threads  # noqa: F401 - its load reading starts at `import ddpkit`
from .errors import UsageError, WorkerFailed
from .version import __version__

# Imports inside functions: `import ddpkit` stays cheap (no torch) until a name that
# needs it is used.

_moved.install()


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name == "EMA":
        from .runtime.ema import EMA

        return EMA
    if name == "EarlyStopping":
        from .runtime.early_stopping import EarlyStopping

        return EarlyStopping
    if name in ("Dropout", "dropout"):
        from .core import draws

        return getattr(draws, name)
    if name == "launch":
        from .launcher import launch

        return launch
    if name in _moved.MOVED:  # ddpkit 0.1's path of a module now in a layer folder: said once
        globals()[name] = found = _moved.module(name)
        return found
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
