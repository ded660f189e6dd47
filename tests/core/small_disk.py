"""A real full disk for the tests: a small tmpfs mounted on a folder (root only; a test skips
itself with the reason where mounting is not permitted)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def small_disk(folder, size: str = "2m") -> Iterator[str]:
    """Mount a tmpfs of `size` on `folder` (made if need be) for the block; yields its path."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], capture_output=True)
