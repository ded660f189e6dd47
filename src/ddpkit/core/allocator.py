"""glibc's allocator and fsdp on CPU: large blocks go back to the system as soon as they are freed.

Every FSDP2 forward and backward all-gathers a unit's parameters into new tensors and frees them
after use; on CPU each is one `malloc` of the unit's size. glibc serves a block above its mmap
threshold (128 KiB at first) with `mmap` and returns it at `free`, but each such `free` raises
the threshold to the freed block's size (up to 32 MiB): from then on blocks of that size come
from the heap, and freed heap memory mostly stays with the process: fsdp's peak RSS on CPU
then exceeds DDP's (measured: docs/fsdp.md, `ddpkit bench strategies`).

Holding it there (`mallopt(M_MMAP_THRESHOLD, 1 MiB)`, which also stops the raising) makes every
block of 1 MiB or more its own mapping, unmapped at `free`. The price is that each new block
is fresh pages the kernel must fault in and zero: step time grows (see docs/fsdp.md for the
measured cost). glibc reads `MALLOC_MMAP_THRESHOLD_` from the environment only when a process
starts, and `ddpkit train` and `ddpkit.launch` fork their CPU workers, so the setting is made
in the worker, by `Runtime` under fsdp, before the model is built: the same for workers of
torchrun, srun or `ddpkit run`.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 1 << 20  # bytes
_M_MMAP_THRESHOLD = -3  # malloc.h
# What a user sets to choose glibc's behaviour themselves: then ddpkit changes nothing.
USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)

_state: str | None = None  # what mmap_large_blocks did in this process


def user_setting() -> str | None:
    """The user's own setting of glibc's allocator in the environment, if any (`NAME=value`)."""
    for name in USER_SETTINGS:
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        return f"GLIBC_TUNABLES={tunables}"
    return None


def mmap_large_blocks(threshold: int = MMAP_THRESHOLD) -> str:
    """Hold glibc's mmap threshold at `threshold` bytes in this process, from now on (blocks
    allocated before keep their place). Does nothing where the user set the allocator up in the
    environment, or where the C library is not glibc. Returns what it did, for records."""
    global _state
    if _state is not None:
        return _state
    user = user_setting()
    if user is not None:
        _state = f"left as the environment sets it ({user})"
    elif platform.libc_ver()[0] != "glibc":
        _state = "left alone (not glibc)"
    else:
        try:
            ok = ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold) == 1
        except (OSError, AttributeError):
            ok = False
        _state = f"mmap threshold {threshold} bytes (mallopt)" if ok else "left alone (mallopt failed)"
    return _state


def state() -> str:
    """What this process's allocator runs with, as far as ddpkit knows."""
    if _state is not None:
        return _state
    user = user_setting()
    return f"as the environment sets it ({user})" if user else "glibc's default (or not glibc)"
