"""Rank-aware output: the one place that decides who prints.

Only global rank 0 prints; other ranks get a logger that does nothing, so user code never
needs `if rank == 0:` and tutorials' duplicated lines ("[GPU0] ... [GPU1] ...") disappear.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import dist


def print0(*args: Any, **kwargs: Any) -> None:
    """`print` on global rank 0 only; flushed so lines from launched workers appear in order."""
    if dist.is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def get_logger(name: str = "ddpkit") -> logging.Logger:
    """A logger that writes to stderr on rank 0 and is silent on the other ranks."""
    logger = logging.getLogger(name if dist.is_main() else f"{name}.silent-rank")
    if not logger.handlers:
        if dist.is_main():
            handler: logging.Handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s ddpkit %(levelname)s: %(message)s"))
            logger.setLevel(logging.INFO)
        else:
            handler = logging.NullHandler()
        logger.addHandler(handler)
        logger.propagate = False
    return logger
