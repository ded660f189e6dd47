"""Where the time of a `ddpkit train` command goes: named moments, in seconds since the
command's process started (its interpreter start included).

The clock is `time.monotonic`, one system-wide clock on Linux, so a forked or spawned worker
can mark moments on the same timeline as the parent that started it; the parent's timeline
travels to the workers with the plan. A reading is one clock read, nothing is synchronized:
on a GPU a moment is when the host got there (the device may still be working).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

_IMPORTED_AT = time.monotonic()  # the origin off Linux: when ddpkit got this far
_froze = False  # gc_paused froze objects in this process (see froze_objects)

# The moments of `ddpkit train`, in the order they happen, and what the phase that ends at
# each one did (results.json's "timeline" holds the ones a run reached).
MOMENTS: dict[str, str] = {
    "imports_done": "interpreter start, the flags parsed, `import torch` and ddpkit's modules",
    "checks_done": "every setting checked, the plan made",
    "workers_started": "the launcher's agent, its rendezvous and the workers' start (fork), torch's compiler imported meanwhile",
    "process_group_ready": "the process group (gloo/NCCL) joined, the runtime made",
    "data_loaded": "the dataset read and split",
    "model_ready": "model built and wrapped (DDP), optimizer, loaders, schedule",
    "first_step_done": "the first training step (its warm-up: first forward, backward, optimizer)",
    "training_done": "every other step, with each epoch's evaluation and checkpoint",
    "outputs_written": "the final results, model.pt (and curves.png where rank 0 waits for it; results.json comes after)",
    "workers_exited": "the workers' exit and the launcher's shutdown",
    "curves_drawn": "the rest of curves.png, drawn by the command's helper while the workers ended",
}


def process_start() -> float:
    """When this process started, on the `time.monotonic` clock: Linux keeps the start time
    (in clock ticks since boot, /proc/self/stat field 22, 10 ms steps) on CLOCK_BOOTTIME,
    which runs beside CLOCK_MONOTONIC. Elsewhere, when ddpkit was first imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT
    return time.monotonic() - age


@dataclass
class Timeline:
    """Named moments of a run, in seconds since `origin` (a `time.monotonic` reading)."""

    origin: float = field(default_factory=process_start)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, at: float | None = None) -> None:
        """Record moment `name` now (or at the monotonic reading `at`); a moment is kept once."""
        if name not in MOMENTS:
            raise ValueError(f"unknown moment {name!r}; known: {', '.join(MOMENTS)}")
        self.marks.setdefault(name, self.now() if at is None else at - self.origin)

    def now(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin

    def seconds(self) -> dict[str, float]:
        """The moments reached, in MOMENTS' order, in seconds since the origin (ms resolution)."""
        return {name: round(self.marks[name], 4) for name in MOMENTS if name in self.marks}


def phases(timeline: dict[str, float]) -> dict[str, float]:
    """Each phase's own seconds (a moment minus the one before it), from a results.json
    "timeline"; the first phase starts at the process's start."""
    out, before = {}, 0.0
    for name in MOMENTS:
        if name in timeline:
            out[name] = timeline[name] - before
            before = timeline[name]
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside; what was made inside is frozen after (left out of
    every later collection), and collections resume.

    Start-up makes hundreds of thousands of objects that live as long as the process
    (`import torch`; the first optimizer imports torch's compiler): collecting while they
    are made finds nothing to free, and without the freeze the first collection after the
    pause would walk them all at once. For start-up code only: a cycle of garbage made
    inside is never freed.
    """
    global _froze
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        _froze = True
        gc.enable()


def froze_objects() -> bool:
    """Whether `gc_paused` froze objects in this process: what a nonzero
    `gc.get_freeze_count()` says, without its walk over every frozen object (about 30 ms
    once torch is imported). (A later `gc.unfreeze()` elsewhere is not seen.)"""
    return _froze
