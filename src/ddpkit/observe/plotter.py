"""curves.png drawn by a helper process, off the critical path of a small run.

Drawing the curves costs about 0.65 s: matplotlib's import (about 0.4 s) and the drawing. A
`ddpkit train` command starts this helper first (`helper()`), before it imports torch: on a
machine of two cores the second one is idle then, and the helper imports matplotlib there,
then waits on its stdin without using the CPU. When training ends, rank 0 (a worker forked
from that command, which inherits the helper's pipes, or the command itself with one
process) hands it the curves (`draw_later`) and goes on with the run's last steps and
model.pt. Whoever writes results.json, which stays the last file written, waits for the
helper's answer first: the command itself, after its workers have ended (a forked rank 0
hands the `Drawing` back with its results), or rank 0 when it is the command.

The figure is the same: the same function of `ddpkit.observe.plots` draws it from the same records
(JSON carries floats exactly). Wherever there is no helper (a spawned worker, a run under
torchrun or srun, `ddpkit.launch`), or it is gone or fails, rank 0 draws in its own process,
as it always did. The helper never outlives the command: it ends when the command closes
its stdin, or is killed when the command fails or is interrupted; were the command killed
outright, the closed pipe ends it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.signals import set_handler
from . import plots

PLOTS = ("plot_curves", "plot_token_curves")  # what a helper draws: ddpkit.observe.plots' functions
ANSWER_TIMEOUT_S = 60.0  # then rank 0 draws the figure itself
EXIT_TIMEOUT_S = 10.0

_helper: subprocess.Popen | None = None  # this process's helper; forked workers inherit it
_owner = 0  # the pid of the process that started the helper: the one that reads its answers
_ids = itertools.count()


@contextlib.contextmanager
def helper() -> Iterator[subprocess.Popen | None]:
    """A helper process for the block (None if it could not start). On leaving normally, its
    stdin is closed and its exit awaited; on an error or an interrupt it is killed."""
    global _helper, _owner
    proc = _start()
    _helper, _owner = proc, os.getpid()
    try:
        yield proc
    except BaseException:
        _stop(proc, kill=True)
        raise
    finally:
        _helper = None
    _stop(proc, kill=False)


def _start() -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # whatever happens there, the run draws the figure itself
        )
    except OSError:
        return None


def _stop(proc: subprocess.Popen | None, kill: bool) -> None:
    if proc is None:
        return
    with contextlib.suppress(OSError):
        if kill:
            proc.kill()
        proc.stdin.close()
    try:
        proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


@dataclass
class Drawing:
    """A figure on its way to `path`: `ddpkit.observe.plots.<name>(*args, path, title)`, asked of the
    helper as `request` (None: no helper took it). Plain data, so a forked worker can hand
    it to the process that started the helper, which alone reads the helper's answers."""

    name: str
    args: list[Any]
    path: str
    title: str
    request: str | None = None
    owner: int = 0  # the process that reads the helper's answer (see `waited_elsewhere`)

    @property
    def waited_elsewhere(self) -> bool:
        """True in a worker forked from the process that started the helper: that process
        waits for the figure (after its workers ended), not this one."""
        return self.request is not None and self.owner != os.getpid()

    def wait(self) -> bool:
        """Until the file is written, drawing it in this process if the helper cannot; True
        if the helper drew it."""
        if self.request is not None and _helper is not None and _answered(_helper, self.request):
            return True

        getattr(plots, self.name)(*self.args, self.path, self.title)
        return False


def draw_later(name: str, args: list[Any], path: str, title: str) -> Drawing:
    """Start drawing `ddpkit.observe.plots.<name>(*args, path, title)`; `wait()` on the result
    before the file is needed."""
    if name not in PLOTS:
        raise ValueError(f"unknown plot {name!r}; known: {', '.join(PLOTS)}")
    # (the helper's working directory is the command's; a worker's may have changed since)
    drawing = Drawing(name, list(args), os.path.abspath(path), title, owner=_owner)
    request = f"{os.getpid()}-{next(_ids)}"
    if _helper is not None and _send(_helper, {"id": request, "plot": name, "args": [*args, drawing.path, title]}):
        drawing.request = request
    return drawing


def _send(proc: subprocess.Popen, request: dict[str, Any]) -> bool:
    try:
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
    except (OSError, ValueError, TypeError):  # the helper is gone, or a record is not JSON
        return False
    return True


def _answered(proc: subprocess.Popen, request: str) -> bool:
    """True once the helper says it wrote the file for `request`; False if it failed, left
    or did not answer in time. (An answer to another request, one a worker that was since
    restarted sent, is skipped.)"""
    # Read from the descriptor, not the buffered file: its readline() may take two answers off
    # the pipe and return one, and select() then waits for the other, which is already read,
    # until the deadline (after a restart, both attempts' rank 0 asked for a figure: a minute).
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    fd = proc.stdout.fileno()
    while True:
        while b"\n" in _unread:
            line, _, rest = bytes(_unread).partition(b"\n")
            _unread[:] = rest
            answer = json.loads(line)
            if answer.get("id") == request:
                return answer.get("ok") is True
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        _unread.extend(chunk)


_unread = bytearray()  # what was read of the helper's answers and not yet taken


def serve() -> None:
    """The helper: import matplotlib, then draw each request read from stdin, answering on
    stdout, until stdin closes."""
    set_handler(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command, which ends this

    curves: Any = _warm_up(plots)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["plot"] not in PLOTS:
                raise ValueError(request["plot"])
            if request["plot"] == "plot_curves" and plots.Curves.redraws(request["args"][0]):
                curves = curves or plots.Curves()  # drawn again in the warm-up's figure: sooner, same bytes
                curves.draw(*request["args"])
            else:
                getattr(plots, request["plot"])(*request["args"])
            ok = True
        except Exception:  # noqa: BLE001 - the run draws it itself, and says what failed there
            if curves is not None and request.get("plot") == "plot_curves":
                curves.close()  # a figure left half drawn is not drawn again
                curves = None
            ok = False
        sys.stdout.write(json.dumps({"id": request["id"], "ok": ok}) + "\n")
        sys.stdout.flush()
    # Nothing left to do: skip the interpreter's teardown (matplotlib's objects).
    os._exit(0)


def _warm_up(plots: Any) -> Any:
    """matplotlib's import, and curves.png's figure drawn once and kept (`plots.Curves`): a
    first figure costs about 0.15 s more than the next ones (fonts, caches), and a figure drawn
    again with a run's records half of what a new one costs, which would otherwise be paid on
    the critical path at the end of the run. What is drawn after it is the same to the byte."""

    epoch = {"epoch": 1, "train_loss": 1.0, "test_loss": 1.0, "train_accuracy": 0.5, "test_accuracy": 0.5}
    curves = plots.Curves()
    with tempfile.TemporaryDirectory(prefix="ddpkit-plotter-") as tmp:
        curves.draw([epoch], os.path.join(tmp, "warm-up.png"), "warm-up")
    return curves


if __name__ == "__main__":
    serve()
