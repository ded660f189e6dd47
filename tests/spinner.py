"""A busy program outside the test's process tree: what another user's job is to ddpkit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass\n"


@contextlib.contextmanager
def outside_spinner() -> Iterator[int]:
    """One core kept busy by a process that is not a descendant of this one (its shell parent
    exits at once, so it is re-parented): ddpkit's load reading counts it as another program's."""
    shell = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!', SPIN],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(shell.stdout.strip())
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
