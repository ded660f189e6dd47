"""The Runtime's checkpoints: what `save_state` keeps without being told and how `load_state`
puts it back, the checks both make before anything is written or loaded, and the background
saves a Runtime waits for when it closes.

A full state holds every model and optimizer given to setup() ('model', 'model_1', ...,
'optimizer', ...), every training loader ('loader', ...: its position), the precision (the
fp16 GradScaler) and 'runtime': the step count, the dropout masks' seed and every rank's random
streams in rank order, each with its loaders' generators. On the same number of processes each
rank gets its own streams back; on another, each starts a fresh one from (seed, rank, step).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .. import checkpoint
from ..checkpoint.shards import Pending
from ..core import dist
from ..core.files import check_writable
from ..core.log import print0
from ..core.seed import gather_rng_states, restore_rng_states
from ..errors import NotSaveState, UsageError

# The entries save_state writes without being told, as load_state finds them.
AUTOMATIC = re.compile(r"(model|optimizer|loader)(_\d+)?|precision")

# How long close() waits for a checkpoint still being written in the background (a large
# checkpoint on a slow disk), before it removes the partial write instead.
PENDING_WAIT_S = 600.0


def entries(models: Sequence[Any], optimizers: Sequence[Any], loaders: Sequence[Any], precision: Any) -> dict[str, Any]:
    """The entries save_state writes besides 'runtime', and load_state loads into."""
    state: dict[str, Any] = {}
    for kind, items in (("model", models), ("optimizer", optimizers), ("loader", loaders)):
        state.update({kind if i == 0 else f"{kind}_{i}": item for i, item in enumerate(items)})
    state["precision"] = precision
    return state


def runtime_entry(steps: int, device: torch.device, loaders: Sequence[Any], draw_seed: int | None) -> dict[str, Any]:
    """The 'runtime' entry: the step count, the masks' seed and every rank's random streams
    (gathered: collective)."""
    generators = [loader.generator for loader in loaders]
    return {"steps": steps, "rng": gather_rng_states(device, generators), "draw_seed": draw_seed}


def restore(run: dict[str, Any], device: torch.device, loaders: Sequence[Any], seed: int) -> tuple[int, int | None]:
    """Put back every rank's random streams from a 'runtime' entry; returns its step count and
    masks' seed (None: a checkpoint older than it, or no dropout of ddpkit's)."""
    steps = int(run["steps"])
    restore_rng_states(run["rng"], device, [loader.generator for loader in loaders], seed, steps)
    draw_seed = run.get("draw_seed")
    return steps, None if draw_seed is None else int(draw_seed)


def check_names(call: str, extra: dict[str, Any], automatic: dict[str, Any]) -> None:
    """Refuse entries of the user's that would take the names of those saved without being told."""
    taken = sorted(set(extra) & (set(automatic) | {"runtime"}))
    if taken:
        raise UsageError(f"rt.{call}: {', '.join(taken)} is saved without being named; give your entries other names")


def check_entries(path: str, ours: set[str], saved: set[str]) -> None:
    """Refuse, before anything is loaded, a checkpoint that is not save_state's, or whose
    models, optimizers and loaders (`ours`: this run's automatic entries) are not this run's."""
    if "runtime" not in saved:
        raise NotSaveState(f"rt.load_state: {path} was not written by rt.save_state (rt.load reads it)")
    theirs = {k for k in saved if AUTOMATIC.fullmatch(k)}
    if ours != theirs:
        raise UsageError(
            f"rt.load_state: {path} holds {', '.join(sorted(theirs))}; this run has {', '.join(sorted(ours))} "
            "(make the same setup() and loader() calls, in the same order, before load_state)"
        )


def load_state(
    path: str | os.PathLike, automatic: dict[str, Any], extra: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """Load a full state into `automatic` and `extra` (checked first: see check_entries)."""

    def check(saved: set[str]) -> None:
        check_entries(os.fspath(path), set(automatic), saved)

    try:
        return checkpoint.load_into(path, {**automatic, **extra}, map_location=device, check=check)
    except KeyError as err:  # an entry of `extra` the checkpoint lacks
        raise UsageError(f"rt.load_state: {err.args[0]}") from None


def check_writable_beside(call: str, path: str | os.PathLike, proven: set[str]) -> None:
    """Rank 0 proves it can write beside `path`, and every rank raises its UsageError alike
    (rather than rank 0 alone, the others left waiting for the file). A folder proven once
    (`proven`: by its name as given, the same on every rank) is not probed again: a write
    that fails there later is the write's own error (a full disk, named)."""
    folder = os.path.dirname(os.fspath(path))
    if folder in proven:
        return
    problem = None
    if dist.is_main():
        try:
            check_writable(f"{call}({os.fspath(path)!r})", os.path.dirname(os.path.abspath(path)))
        except UsageError as err:
            problem = str(err)
    problem = dist.broadcast_object(problem)
    if problem:
        raise UsageError(problem)
    proven.add(folder)


class Background:
    """The background saves not known to be complete, which close() waits for."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def track(self, pending: Pending | None) -> Pending | None:
        if pending is not None:
            self.pending = [p for p in self.pending if not p.done()] + [pending]
        return pending

    def finish(self) -> None:
        """A background save must finish or vanish before the process groups its write uses are
        torn down: torn down under it, each rank would write alone over the others' files and
        rank 0 rename a directory of half-written tensors into place. So close() waits for it,
        saying so, for at most PENDING_WAIT_S; then the partial directory is removed."""
        pending, self.pending = [p for p in self.pending if not p.done()], []
        for p in pending:
            print0(
                f"ddpkit: checkpoint {p.path} is still being written in the background: waiting for it "
                "before closing (wait() on what save(background=True) returned says when it is complete)",
                file=sys.stderr,
            )
            try:
                p.wait(PENDING_WAIT_S)
            except TimeoutError:
                p.abandon()
                print0(
                    f"ddpkit: checkpoint {p.path}: not complete after {PENDING_WAIT_S:g} s; its partial write removed",
                    file=sys.stderr,
                )
            except OSError as err:  # the write failed: nothing was put in place
                print0(f"ddpkit: {err}", file=sys.stderr)
