"""The run directory (`--out`): one run at a time, only real files, no leftovers of a write
that a crash interrupted.

- One run at a time. The launching process locks `--out/.lock` (`files.hold_lock`) before any
  worker starts and keeps it until it exits; a second run there exits 2 naming the holder's
  pid, host and start time. A run that was killed leaves the file but not the lock (the kernel
  drops it with the process), so the next run takes it over. Under torchrun or srun every rank
  is a launching process of its own, and only global rank 0, the rank that writes the
  outputs, takes it. In a `--nnodes` job started by ddpkit on each machine, the node given
  `--node-rank 0` takes it, the one that hosts the rendezvous (without `--node-rank`, none
  does). c10d does not promise that node global rank 0, the rank that writes `--out`: the lock
  guards an `--out` on a shared filesystem, not one local to each machine.
- Only real files. A symbolic link among the names a run writes (`checkpoints`, `metrics.jsonl`,
  ...) or inside `checkpoints/` is refused with exit 2: writes replace a link rather than
  follow it (`files.atomic_write`), but a linked folder would still take every checkpoint, and
  their pruning, somewhere else.
- No leftovers. The temp files of writes that a crash interrupted (`.tmp-*`) are removed once the
  lock is held, and again after the elastic agent restarted the workers.
"""

from __future__ import annotations

import os
import sys

from ..checkpoint import shards
from ..core.dist import detect_env
from ..core.files import check_unlocked, describe_holder, hold_lock, prune_temp_files
from ..errors import UsageError

LOCK = ".lock"
ADVICE = "wait for that run to end, or choose another --out"
# What a run writes in --out. None of these may be a symbolic link.
WRITTEN = (
    "checkpoints",
    "metrics.jsonl",
    "metrics.csv",
    "config.yaml",
    "tensorboard",
    "mlflow",
    "wandb",
    "trackers.json",
    "model.pt",
    "results.json",
    "curves.png",
    LOCK,
)


def takes_lock(nnodes: str, node_rank: int | None) -> bool:
    """True in the one launching process of a job that locks `--out` (see the module's notes)."""
    env = detect_env()
    if env.source != "single":
        return env.rank == 0
    return str(nnodes).strip() in ("1", "1:1") or node_rank == 0


def check(out: str, locks: bool) -> None:
    """Before anything else is checked or written: `out` is not held by another run (for the
    process that would lock it), and holds no link where the run writes. Writes nothing."""
    if not os.path.isdir(out):
        return
    check_no_links(out)
    if locks:
        check_unlocked(os.path.join(out, LOCK), f"--out {out}", ADVICE)


def claim(out: str) -> None:
    """Lock `out` for this process's life, then remove the temp files of interrupted writes."""
    previous = hold_lock(os.path.join(out, LOCK), f"--out {out}", ADVICE)
    if previous:
        print(
            f"ddpkit train: note: --out {out} was held by {describe_holder(previous)}, which ended without "
            f"releasing it (killed?); taking it over",
            file=sys.stderr,
        )
    check_no_links(out)  # again, now that no other run of ours can be changing it
    prune_partial_writes(out)


def check_no_links(out: str) -> None:
    """UsageError naming the first symbolic link among the names a run writes in `out`."""
    folder = os.path.join(out, "checkpoints")
    names = [os.path.join(out, n) for n in WRITTEN]
    if os.path.isdir(folder) and not os.path.islink(folder):
        names += [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
    for path in names:
        if os.path.islink(path):
            raise UsageError(
                f"--out {out}: {path} is a symbolic link (to {os.readlink(path)}); a run writes only real files "
                f"in its directory: remove the link"
            )


def prune_partial_writes(out: str) -> None:
    """Remove the `.tmp-*` files of writes that a crash interrupted, in `out` and its checkpoints,
    once any checkpoint a crash left renamed aside is back in place (`shards.recover_replaced`)."""
    shards.recover_replaced(os.path.join(out, "checkpoints"))
    for folder in (out, os.path.join(out, "checkpoints")):
        prune_temp_files(folder)
