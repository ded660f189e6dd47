"""The suite on several cores: pytest-xdist's workers (`python -m pytest -n auto`), each a pytest
process that takes whole test files (`--dist loadfile`, so a module's shared runs are made once).
Two things stop a worker from getting in the other's way:

- `made_once`: a run that tests in several files read (the session's `two_process_run`, say) is
  made by the first worker that asks for it; the others wait for it and read the same result.
  Both use the folder that the run's workers share (`gate`, `turn`, NAME.lock, NAME.pickle).
- the `alone` marker: a test whose assertions read the machine's load or time a short operation
  (the thread choice, a bound in milliseconds) runs while no other worker runs a test. Every
  other test holds a shared turn, an `alone` test the only one: a readers-writer lock over two
  files (fcntl.flock), where a waiting `alone` test holds the gate, so later tests queue behind
  it instead of starving it.

Without xdist (`python -m pytest` alone, or -n 0) neither does anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_WORKERS = 4  # `-n auto`: one worker per usable core, at most this many


def auto_workers() -> int:
    """The number of workers `-n auto` starts: one per core this process may use (its affinity,
    a cgroup's quota), at most MAX_WORKERS. Each test's runs take their share of the cores
    (DDPKIT_THREADS=share), so more workers than cores would only queue."""
    from ddpkit.core.threads import usable_cores

    return max(1, min(usable_cores(), MAX_WORKERS))


def shared_folder(config) -> Path | None:
    """The folder all workers of this run share, None outside xdist: the run's base temporary
    folder, above each worker's own (xdist gives worker gwN the base `<run's>/popen-gwN`)."""
    if getattr(config, "workerinput", None) is None:
        return None
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def turn(config, alone: bool):
    """Hold this worker's turn to run a test: shared, or the only one when `alone`."""
    folder = shared_folder(config)
    if folder is None:
        yield
        return
    with open(folder / "gate", "a") as gate, open(folder / "turn", "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)  # queue: an `alone` test waiting here keeps it
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


def made_once(config, name: str, make: Callable[[], Any]) -> Any:
    """`make()`'s result, made by one worker of the run and read by the others (in one process,
    simply made). It must pickle, and its files must live under tmp_path_factory's folders, which
    stay until the run is over (pytest removes a run's folders only in a later run). A `make` that raises leaves nothing behind: the next worker to
    ask tries again, and fails with its own error."""
    shared = shared_folder(config)
    if shared is None:
        return make()
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        result = make()
        done.write_bytes(pickle.dumps(result))
        return result
