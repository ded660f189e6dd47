"""Resume policy: which checkpoint a run continues from, and what a checkpoint must match.

`--resume PATH` is checked before anything starts; `--resume auto` takes the newest usable
checkpoint in `--out`/checkpoints, skipping damaged ones (a crash mid-write, a full disk) but
never one this run's settings cannot continue (it would silently train something else).
A restart by the elastic agent always continues from the newest complete checkpoint.

`RunState` is what a checkpoint holds besides model, optimizer, scheduler, scaler and loader
position: loop counters, history, the epoch's running sums, every rank's random streams, and
the settings it was trained with.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from .. import checks, models
from ..checkpoint import load_file
from ..errors import IncompatibleCheckpoint, UsageError
from ..seed import rng_state, seed_rank, set_rng_state
from .config import TrainConfig

if TYPE_CHECKING:
    from ..runtime import Runtime


def starting_point(cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int) -> str | None:
    """The checkpoint a fresh launch of `cfg` starts from (None: from scratch)."""
    path = resume_path(cfg, in_shape, num_classes)
    if cfg.resume is None and checkpoint_names(os.path.join(cfg.out, "checkpoints")) and not restarted():
        # A fresh run here would prune the old run's checkpoints as its own and leave a mix.
        raise UsageError(
            f"--out {cfg.out} already holds a run's checkpoints: continue it with --resume auto, "
            f"or choose another --out"
        )
    return path


def after_restart(cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int) -> str | None:
    """After the elastic agent restarted the workers (a worker died), the newest complete
    checkpoint to carry on from, whatever the command line said (None: not restarted, or
    nothing saved yet)."""
    if not restarted():
        return None
    return resume_path(dataclasses.replace(cfg, resume="auto"), in_shape, num_classes, allow_finished=True)


def restarted() -> int:
    """How many times the elastic agent has restarted this job's workers (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_path(
    cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int, allow_finished: bool = False
) -> str | None:
    """The checkpoint to resume from: `--resume PATH` (checked), or with `--resume auto` the
    newest usable one in `--out`/checkpoints (None when there is none yet). `allow_finished`
    accepts a checkpoint of the last epoch (a restart after training, before the outputs)."""
    if cfg.resume is None:
        return None
    if cfg.resume != "auto":
        try:
            check_resumable(cfg.resume, cfg, in_shape, num_classes)
        except UsageError as err:
            raise UsageError(f"--resume: {err}") from None
        return cfg.resume
    folder = os.path.join(cfg.out, "checkpoints")
    for name in reversed(checkpoint_names(folder)):  # newest first; temp files of an interrupted write never match
        path = os.path.join(folder, name)
        try:
            check_resumable(path, cfg, in_shape, num_classes, allow_finished)
            return path
        except IncompatibleCheckpoint as err:
            # Starting afresh here would overwrite the run's metrics and checkpoints.
            raise UsageError(f"--resume auto: {err}") from None
        except UsageError:
            continue  # damaged (a crash mid-write, a full disk): fall back to an older one
    return None


def check_resumable(
    path: str, cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int, allow_finished: bool = False
) -> None:
    """Raise UsageError unless `path` is a readable training checkpoint that this config can
    continue: same model, optimizer and dataset, and epochs left to run."""
    state = load_file(path)  # missing, truncated, corrupt or code-carrying files stop here
    need = ("model", "optimizer", "scheduler", "loader", "run")
    missing = [k for k in need if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path}: not a ddpkit training checkpoint (no {', '.join(missing)})")
    run = state["run"]
    # What decides the data order and the parameters: changing them mid-run trains something else.
    # (--nproc, --micro-batch-size and --precision may change: they do not.)
    for key in RESUME_MUST_MATCH:
        if key in run and run[key] != getattr(cfg, key):
            flag = checks.flag(key)
            raise IncompatibleCheckpoint(
                f"checkpoint {path}: was trained with {flag} {run[key]}; this run has {flag} {getattr(cfg, key)}"
            )
    if run["epoch"] >= cfg.epochs and not (allow_finished and run["epoch"] == cfg.epochs):
        raise IncompatibleCheckpoint(
            f"checkpoint {path}: the run already finished its {run['epoch']} epochs; raise --epochs to continue it"
        )
    model = models.build(cfg.model, in_shape, num_classes)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise IncompatibleCheckpoint(
            f"checkpoint {path}: its weights do not fit --model {cfg.model} ({first})"
        ) from None


# The optimizer's and scheduler's saved state would silently override a changed --lr,
# --weight-decay or scaling, so those must match too. --epochs may grow (that is how a finished
# run continues); the cosine schedule then stretches over the new total.
RESUME_MUST_MATCH = (
    "model",
    "optimizer",
    "data",
    "batch_size",
    "seed",
    "num_classes",
    "synthetic_shape",
    "synthetic_size",
    "lr",
    "weight_decay",
    "lr_scaling",
    "reference_batch_size",
    "warmup_epochs",
    "augment",
    "crop_padding",
    "label_smoothing",
    "momentum",
)


def checkpoint_names(folder: str) -> list[str]:
    """Complete checkpoints in `folder`, oldest first. Writes go to '.tmp-*' files renamed
    only when complete, so a half-written file never has a checkpoint's name."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.startswith("step-") and n.endswith(".pt"))


class RunState:
    """Loop counters, history, the epoch's running sums and every rank's random streams: what a
    checkpoint holds besides model, optimizer, scheduler, scaler and loader position. Also
    records what the run was trained with, so a resume with other settings is refused."""

    def __init__(self, cfg: TrainConfig, device: torch.device, loader_generator: torch.Generator | None = None) -> None:
        self.cfg, self.loader_generator = cfg, loader_generator  # the generator seeds DataLoader workers
        self.epoch = self.step = self.start_step = self.skipped = 0
        self.history: list[dict[str, Any]] = []
        # This epoch so far, on the device (no sync per step): loss * n, correct, n.
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def state_dict(self, rt: Runtime) -> dict[str, Any]:
        """Collective (all-reduces the sums, gathers the random states); rank 0 keeps the result."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
            "skipped": self.skipped,
            **{key: getattr(self.cfg, key) for key in RESUME_MUST_MATCH},
            "sums": rt.all_reduce(self.sums.clone()).cpu(),
            "world_size": rt.world_size,
            "rng": rt.gather_objects(rng_state(rt.device, self.loader_generator)),
        }

    def restore(self, checkpoint: dict[str, Any], rt: Runtime) -> None:
        state = checkpoint["run"]
        self.epoch = int(state["epoch"])
        self.step = self.start_step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))
        self.history = list(state["history"])
        # The epoch's sums so far were summed over all ranks: one rank carries them on.
        self.sums = state["sums"].to(rt.device) if rt.is_main else torch.zeros_like(self.sums)
        if int(state["world_size"]) == rt.world_size:
            # the very streams an uninterrupted run would have
            set_rng_state(state["rng"][rt.rank], rt.device, self.loader_generator)
        else:
            seed_rank(self.cfg.seed, rt.rank, self.step)  # no such rank before: a fresh stream, reproducibly
