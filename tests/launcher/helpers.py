"""Helpers for the launcher tests: a Python program read from stdin, run as a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import SRC


def run_python(program: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-"], input=textwrap.dedent(program), capture_output=True, text=True, timeout=timeout, env=env
    )
