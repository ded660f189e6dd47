"""Helpers for the command-line tests: the digits split's sizes, and a command that must succeed."""

from __future__ import annotations

DIGITS_TRAIN, DIGITS_TEST = 1438, 359


def ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
