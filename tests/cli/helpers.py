"""Helpers for the command-line tests: the digits split's sizes, a command that must succeed, a free port."""

from __future__ import annotations

DIGITS_TRAIN, DIGITS_TEST = 1438, 359


def ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def free_port() -> int:
    """A TCP port free on the loopback address now (the OS picks it): tests never use fixed ports."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
