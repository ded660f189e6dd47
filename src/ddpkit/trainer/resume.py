"""Resume policy: which checkpoint a run continues from, and what a checkpoint must match.

`--resume PATH` is checked before anything starts; `--resume auto` takes the newest usable
checkpoint in `--out`/checkpoints, skipping damaged ones (a full disk, a copy, flipped bytes that
no longer match their checksums, a name that is not its state's step) with a line each, but never one this run's settings cannot continue (it would silently train something
else), and never starting over when checkpoints exist and none is usable (the progress would be
thrown away). A restart by the elastic agent always continues from the newest complete checkpoint.
Every checkpoint read for a resume is checked whole here, keys and types, so that a damaged
one is one line and exit 2 rather than a KeyError in every worker.

`RunState` is what a checkpoint holds besides model, optimizer, scheduler, scaler and loader
position: loop counters, history, the epoch's running sums, the early-stopping state, every
rank's random streams, and the settings it was trained with.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import torch

from .. import models
from ..checkpoint import load_file, shards
from ..core import checks
from ..core.dist import detect_env
from ..core.files import TEMP_PREFIX
from ..errors import IncompatibleCheckpoint, UsageError
from ..launcher.records import current_attempt
from ..optim import build_optimizer
from ..runtime.early_stopping import EarlyStopping
from . import rundir
from .config import TrainConfig, model_options

if TYPE_CHECKING:
    from ..runtime import Runtime


def starting_point(cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int) -> str | None:
    """The checkpoint a fresh launch of `cfg` starts from (None: from scratch)."""
    if cfg.resume not in (None, "auto") and not current_attempt():
        _check_out_for(cfg.resume, cfg.out)
    path = resume_path(cfg, in_shape, num_classes)
    if cfg.resume is None and checkpoint_names(os.path.join(cfg.out, "checkpoints")) and not current_attempt():
        # A fresh run here would prune the old run's checkpoints as its own and leave a mix.
        raise UsageError(
            f"--out {cfg.out} already holds a run's checkpoints: continue it with --resume auto, "
            f"or choose another --out"
        )
    return path


def _check_out_for(resume: str, out: str) -> None:
    """`--resume PATH` writes into `--out`: refuse an `--out` that holds another run's outputs
    (they would be overwritten, and two runs' records mixed in one metrics.jsonl). An empty or
    new `--out`, or PATH's own run (PATH in `--out`/checkpoints), is fine."""
    own = os.path.join(os.path.realpath(out), "checkpoints")
    if os.path.dirname(os.path.realpath(resume)) == own:
        return
    held = [name for name in rundir.WRITTEN if os.path.lexists(os.path.join(out, name))]
    if held:
        raise UsageError(
            f"--out {out} holds another run ({', '.join(held[:3])}): resuming {resume} there would overwrite "
            f"its outputs and mix two runs' records; choose an empty --out, or the checkpoint's own run's"
        )


def after_restart(cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int) -> str | None:
    """After the elastic agent restarted the workers (a worker died), the newest complete
    checkpoint to carry on from, whatever the command line said (None: not restarted, or
    nothing saved yet)."""
    if not current_attempt():
        return None
    rundir.prune_partial_writes(cfg.out)  # the writes the failed workers left half done
    return resume_path(dataclasses.replace(cfg, resume="auto"), in_shape, num_classes, allow_finished=True)


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
    main = detect_env().rank == 0  # under torchrun every rank gets here; say it once
    for name in shards.recover_replaced(folder):  # a crash between the two renames of a replace
        if main:
            print(f"ddpkit train: note: {folder}/{name} restored: a crash had left it renamed aside", file=sys.stderr)
    skipped = []
    for name in reversed(checkpoint_names(folder)):  # newest first; temp files of an interrupted write never match
        path = os.path.join(folder, name)
        try:
            check_resumable(path, cfg, in_shape, num_classes, allow_finished)
        except IncompatibleCheckpoint as err:
            # Starting afresh here would overwrite the run's metrics and checkpoints.
            raise UsageError(f"--resume auto: {err}") from None
        except UsageError as err:  # damaged (a full disk, a copy): fall back to an older one
            skipped.append((name, str(err).removeprefix(f"checkpoint {path}: ")))
            continue
        if main:
            for skipped_name, why in skipped:
                print(f"ddpkit train: warning: --resume auto: skipped {folder}/{skipped_name}: {why}", file=sys.stderr)
        return path
    if skipped:
        # Starting over would throw the run's progress away: the user decides.
        reasons = "; ".join(f"{n}: {why}" for n, why in skipped)
        raise UsageError(
            f"--resume auto: none of the {len(skipped)} checkpoints in {folder} is usable ({reasons}); "
            f"move them away to start over, or give --resume PATH"
        )
    unfinished = [n for n in (os.listdir(folder) if os.path.isdir(folder) else []) if n.startswith(TEMP_PREFIX)]
    if unfinished and main:  # starting over where checkpoints were being written is never silent
        print(
            f"ddpkit train: note: --resume auto: no complete checkpoint in {folder}, only {len(unfinished)} "
            f"unfinished write(s) (removed): starting from step 0",
            file=sys.stderr,
        )
    return None


def check_resumable(
    path: str, cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int, allow_finished: bool = False
) -> None:
    """Raise UsageError unless `path` is a readable training checkpoint that this config can
    continue: same model, optimizer and dataset, and epochs left to run."""
    sharded = shards.is_checkpoint_dir(path)
    if sharded:  # fsdp's checkpoint directory: its metadata and state.pt, checked, and every file's checksum
        metadata = shards.read_metadata(path)
        state = {**shards.read_rest(path), "model": {}, "optimizer": {}}
        shards.verify(path)
        shards.check_values(path, metadata)  # non-tensor entries, as a resume will load them
    else:
        state = load_file(path)  # missing, truncated, corrupt or code-carrying files stop here
    need = ("model", "optimizer", "scheduler", "loader", "run")
    missing = [k for k in need if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path}: not a ddpkit training checkpoint (no {', '.join(missing)})")
    problem = state_problem(state)
    if problem:
        raise UsageError(f"checkpoint {path}: damaged or not written by ddpkit train ({problem})")
    run = state["run"]
    named = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    if named and int(named[1]) != run["step"]:  # a copy or a rename put another step's state here
        raise UsageError(
            f"checkpoint {path}: damaged (it holds the state of step {run['step']}, not of the step its name says)"
        )
    # What decides the data order and the parameters: changing them mid-run trains something else.
    # (--nproc, --micro-batch-size and --precision may change: they do not.)
    for key in RESUME_MUST_MATCH:
        saved = run.get(key, BEFORE.get(key, getattr(cfg, key)))
        if saved != getattr(cfg, key):
            flag, now = checks.flag(key), getattr(cfg, key)
            trained = f"without {flag}" if saved is None else f"with {flag} {saved}"
            raise IncompatibleCheckpoint(
                f"checkpoint {path}: was trained {trained}; this run has {f'no {flag}' if now is None else f'{flag} {now}'}"
            )
    if run["epoch"] >= cfg.epochs and not (allow_finished and run["epoch"] == cfg.epochs):
        raise IncompatibleCheckpoint(
            f"checkpoint {path}: the run already finished its {run['epoch']} epochs; raise --epochs to continue it"
        )
    model = models.build(cfg.model, in_shape, num_classes, **model_options(cfg))
    saved = shards.saved_shapes(metadata, "model") if sharded else state["model"]
    if any(name.endswith(".attn.qkv.weight") for name in saved):
        raise IncompatibleCheckpoint(
            f"checkpoint {path}: a gpt of ddpkit 0.2 (one fused q, k, v map per block, now three): its weights "
            "still load into today's gpt (model.pt, load_state_dict), but its optimizer state cannot continue; "
            "start a new run"
        )
    if sharded:
        want = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        problem = shards.shape_problem(shards.saved_shapes(metadata, "model"), want)
        if problem:
            raise IncompatibleCheckpoint(f"checkpoint {path}: its weights do not fit --model {cfg.model} ({problem})")
        if not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata):
            raise UsageError(f"checkpoint {path}: damaged or not written by ddpkit train (no optimizer state)")
        return
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise IncompatibleCheckpoint(
            f"checkpoint {path}: its weights do not fit --model {cfg.model} ({first})"
        ) from None
    try:
        build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.momentum).load_state_dict(state["optimizer"])
    except Exception as err:  # noqa: BLE001 - torch fails in many ways on a damaged state
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(
            f"checkpoint {path}: damaged or not written by ddpkit train (its optimizer state does not load: "
            f"{type(err).__name__} {first})"
        ) from None


# What `RunState.state_dict` writes, and `RunState.restore` and `Loop.restore` read: entry -> type.
RUN_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "epoch": int,
    "step": int,
    "world_size": int,
    "history": list,
    "sums": torch.Tensor,
}
# What rt.save_state's 'runtime' entry holds (ddpkit 0.1's trainer kept the streams in its run state).
RUNTIME_TYPES: dict[str, type | tuple[type, ...]] = {"steps": int, "rng": (list, tuple)}
RNG_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "torch": torch.Tensor,
    "python": (list, tuple),
    "numpy": (list, tuple),
    "cuda": (torch.Tensor, type(None)),
}
PLAIN = (bool, int, float, str, list, tuple, type(None))  # what a setting of RESUME_MUST_MATCH is saved as


def state_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with a training checkpoint's entries, in a few words (None: nothing).
    Keys and types only: whether the settings and the weights fit the run is checked apart."""
    for key in ("model", "optimizer", "scheduler", "loader", "run"):
        if not isinstance(state[key], dict):
            return f"its {key!r} entry is {type(state[key]).__name__}, not a dict"
    loader = state["loader"]
    for key, default in (("epoch", None), ("position", 0)):  # DistributedLoader.load_state_dict's reads
        if not _count(loader.get(key, default)):
            return f"its loader state {key!r} is {_shown(loader.get(key))}, not a count"
    if not _count(state["scheduler"].get("last_epoch", 0)):
        return f"its scheduler state 'last_epoch' is {_shown(state['scheduler'].get('last_epoch'))}, not a count"
    ema = state.get("ema", {})  # a file's EMA (a directory's is in its shards)
    if not isinstance(ema, dict) or not all(isinstance(t, torch.Tensor) for t in ema.values()):
        return f"its 'ema' entry is {_shown(ema)}, not a dict of tensors"
    run = state["run"]
    problem = _run_problem(run)
    if problem:
        return problem
    if written_before_save_state(state):
        runtime, where = {"steps": run["step"], "rng": run["rng"]}, "run state"
    else:
        runtime, where = state.get("runtime"), "runtime state"
        if not isinstance(runtime, dict):
            return "it has no 'runtime' entry (the step count and random streams)"
    for key, kind in RUNTIME_TYPES.items():
        if key not in runtime:
            return f"its {where} has no {key!r}"
        if not isinstance(runtime[key], kind) or (kind is int and not _count(runtime[key])):
            return f"its {where} {key!r} is {_shown(runtime[key])}, not {_kind_name(kind)}"
    if not isinstance(runtime.get("draw_seed"), (int, type(None))) or isinstance(runtime.get("draw_seed"), bool):
        return f"its runtime state 'draw_seed' is {_shown(runtime['draw_seed'])}, not a seed"
    return _streams_problem(runtime["rng"], run["world_size"])


def _run_problem(run: dict[str, Any]) -> str | None:
    for key, kind in {**RUN_STATE_TYPES, "skipped": int}.items():
        if key == "skipped" and key not in run:
            continue  # older checkpoints lack it; restore reads 0
        if key not in run:
            return f"its run state has no {key!r}"
        if not isinstance(run[key], kind) or (kind is int and not _count(run[key])):
            return f"its run state {key!r} is {_shown(run[key])}, not {_kind_name(kind)}"
    for key in RESUME_MUST_MATCH:
        if key in run and not isinstance(run[key], PLAIN):
            return f"its run state {key!r} is {_shown(run[key])}, not a setting"
    if "early_stop" in run and _early_stop_problem(run["early_stop"]):
        return f"its run state 'early_stop' is {_shown(run['early_stop'])}, not an early-stopping state"
    if run["world_size"] < 1:
        return "its run state has world_size 0"
    if run["sums"].numel() != 3:
        return f"its run state has {run['sums'].numel()} running sums, not 3"
    if not all(isinstance(record, dict) for record in run["history"]):
        return "its run state 'history' holds something other than epoch records"
    return None


def _streams_problem(rng: list[Any] | tuple[Any, ...], world_size: int) -> str | None:
    """What is wrong with every rank's random streams, saved by `world_size` processes."""
    if len(rng) != world_size:
        return f"it has {len(rng)} random states for world size {world_size}"
    return next(filter(None, (_rng_problem(rank, r) for rank, r in enumerate(rng))), None)


def _early_stop_problem(state: Any) -> bool:
    """True unless `state` is what `EarlyStopping.state_dict` writes."""
    kinds = {"best": float, "bad_checks": int, "stopped": bool}
    return not isinstance(state, dict) or any(not isinstance(state.get(k), kind) for k, kind in kinds.items())


def _rng_problem(rank: int, rng: Any) -> str | None:
    if not isinstance(rng, dict):
        return f"the random state of rank {rank} is {_shown(rng)}, not a dict"
    for key, kind in RNG_STATE_TYPES.items():
        if key not in rng:
            return f"the random state of rank {rank} has no {key!r}"
        if not isinstance(rng[key], kind):
            return f"the random state of rank {rank} has {key!r} {_shown(rng[key])}, not {_kind_name(kind)}"
    if rng["torch"].dtype != torch.uint8:
        return f"the random state of rank {rank} has a torch state of {rng['torch'].dtype}, not bytes"
    if len(rng["python"]) != 3 or len(rng["numpy"]) != 5 or not isinstance(rng["numpy"][1], torch.Tensor):
        return f"the random state of rank {rank} does not hold Python's and NumPy's states"
    if not _python_stream(rng["python"][1]):
        return f"the random state of rank {rank} does not hold Python's 625 numbers"
    if not isinstance(rng.get("loader"), (torch.Tensor, type(None))):
        return f"the random state of rank {rank} has 'loader' {_shown(rng.get('loader'))}, not a tensor"
    generators = rng.get("generators", [])
    if not isinstance(generators, (list, tuple)) or not all(
        isinstance(g, (torch.Tensor, type(None))) for g in generators
    ):
        return f"the random state of rank {rank} has 'generators' {_shown(generators)}, not a list of tensors"
    return None


def _python_stream(numbers: Any) -> bool:
    """Python's Mersenne Twister state: 625 integers, as one int64 tensor (or, in checkpoints
    of ddpkit 0.1, a tuple)."""
    if isinstance(numbers, torch.Tensor):
        return numbers.dtype == torch.int64 and numbers.shape == (625,)
    return isinstance(numbers, (list, tuple)) and len(numbers) == 625 and all(type(n) is int for n in numbers)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, (int, float, str, type(None))) else type(value).__name__
    return checks.cut(text, 40)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "a count", list: "a list", torch.Tensor: "a tensor", dict: "a dict"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds if k is not type(None) and k is not tuple) or "None"


# The optimizer's and scheduler's saved state would silently override a changed --lr,
# --weight-decay or scaling, so those must match too. --epochs may grow (that is how a finished
# run continues); the cosine schedule then stretches over the new total. --max-grad-norm
# changes every update as --label-smoothing does: set, changed or dropped mid-run, the result
# is a run nobody asked for (a checkpoint from before it existed holds none: not checked).
# --ema likewise: a changed decay mid-run averages into weights no run with either decay has.
# What a checkpoint older than a setting was trained with: without --ema, without --gpt-dropout,
# a GPT-2-shaped gpt.
BEFORE = {"ema": None, "gpt_dropout": 0.0, "gpt_style": "gpt2", "gpt_kv_heads": None, "gpt_hidden": None}
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
    "max_grad_norm",
    "ema",
    "text_path",
    "seq_len",
    "gpt_width",
    "gpt_depth",
    "gpt_heads",
    "gpt_dropout",
    "gpt_style",
    "gpt_kv_heads",
    "gpt_hidden",
)


def newest_checkpoint(out: str) -> str | None:
    """The path of the newest complete checkpoint in `out`/checkpoints, or None."""
    folder = os.path.join(out, "checkpoints")
    names = checkpoint_names(folder)
    return os.path.join(folder, names[-1]) if names else None


def last_checkpoint(out: str) -> str:
    """'last checkpoint DIR/checkpoints/step-N.pt (continue with --resume auto)', or that there
    is none: what an interrupted run says."""
    newest = newest_checkpoint(out)
    return f"last checkpoint {newest} (continue with --resume auto)" if newest else "no checkpoint was written yet"


CHECKPOINT_NAME = re.compile(r"step-(\d+)(\.pt)?")  # a file, or (fsdp) a directory of shards


def checkpoint_names(folder: str) -> list[str]:
    """Complete checkpoints in `folder`, oldest first: 'step-N.pt' files and (fsdp) 'step-N'
    directories. Writes go to '.tmp-*' names renamed only when complete, so a half-written
    checkpoint never has a checkpoint's name."""
    if not os.path.isdir(folder):
        return []
    found = [(m, n) for n in os.listdir(folder) if (m := CHECKPOINT_NAME.fullmatch(n))]
    return [n for m, n in sorted(found, key=lambda pair: (int(pair[0][1]), pair[1]))]


class RunState:
    """Loop counters, history, the epoch's running sums and the early-stopping state: what a
    checkpoint holds besides what `rt.save_state` saves (models, optimizers, loader position,
    scaler, the step count and every rank's random streams) and the scheduler and EMA. Also
    records what the run was trained with, so a resume with other settings is refused."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.epoch = self.step = self.start_step = self.skipped = 0
        self.history: list[dict[str, Any]] = []
        patience = cfg.early_stop_patience
        self.early_stop = EarlyStopping(patience, cfg.early_stop_min_delta) if patience else None
        # This epoch so far, on the device (no sync per step): loss * n, correct, n.
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def state_dict(self, rt: Runtime, sums: list[float] | None = None) -> dict[str, Any]:
        """Collective (all-reduces the sums, unless `sums` holds them summed over the ranks
        already); rank 0 keeps the result."""
        summed = rt.all_reduce(self.sums.clone()).cpu() if sums is None else torch.tensor(sums, dtype=torch.float64)
        return {
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
            "skipped": self.skipped,
            **({"early_stop": self.early_stop.state_dict()} if self.early_stop else {}),
            **{key: getattr(self.cfg, key) for key in RESUME_MUST_MATCH},
            "sums": summed,
            "world_size": rt.world_size,
        }

    def restore(self, checkpoint: dict[str, Any], rt: Runtime) -> None:
        state = checkpoint["run"]
        self.epoch = int(state["epoch"])
        self.step = self.start_step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))
        self.history = list(state["history"])
        if self.early_stop is not None and "early_stop" in state:  # else: counting starts here
            self.early_stop.load_state_dict(state["early_stop"])
        # The epoch's sums so far were summed over all ranks: one rank carries them on.
        self.sums = state["sums"].to(rt.device) if rt.is_main else torch.zeros_like(self.sums)


def written_before_save_state(state: dict[str, Any]) -> bool:
    """True for a checkpoint of ddpkit 0.1's trainer, which kept every rank's random streams in
    its run state (each with its loader's generator) rather than in rt.save_state's entry."""
    return "runtime" not in state and "rng" in state.get("run", {})


def runtime_entry(run: dict[str, Any]) -> dict[str, Any]:
    """rt.save_state's 'runtime' entry for such a checkpoint's run state: the optimizer steps
    taken (skipped ones did not step), and each rank's streams with its loader's generator."""
    rng = [{**r, "generators": [r.get("loader")]} for r in run["rng"]]
    return {"steps": int(run["step"]) - int(run.get("skipped", 0)), "rng": rng, "draw_seed": None}
