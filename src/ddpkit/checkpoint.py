"""Checkpoint files: written atomically, read without unpickling code.

A write goes to a temp file in the same directory, is flushed to disk, and renamed over the
target, so a crash mid-write leaves the previous file intact. Reads use
`torch.load(weights_only=True)`: tensors, numbers, strings and containers only.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

import torch

from .errors import UsageError


def save_file(path: str | os.PathLike, obj: Any) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        # mkstemp makes the file owner-only; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Load a file written by `save_file` or `torch.save`. A missing, truncated, corrupted or
    code-carrying file raises UsageError with one line naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {path}: no such file")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch names the global it refused to import; anything else is garbage, not a threat.
        refused = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
        if refused:
            raise UsageError(f"checkpoint {path}: refused, loading it would run code ({refused[0]})") from None
        raise UsageError(f"checkpoint {path}: not a readable PyTorch file (corrupt or not a checkpoint)") from None
    except Exception as err:  # noqa: BLE001 - garbage bytes can fail anywhere inside the unpickler
        raise UsageError(f"checkpoint {path}: not a readable PyTorch file ({type(err).__name__})") from None
