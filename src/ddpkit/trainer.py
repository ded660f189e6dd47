"""The built-in training loop behind `ddpkit train`, on top of `Runtime`.

`train(cfg)` runs in the parent: it checks everything that can be checked before a process
starts (bad input exits 2 there), then runs `fit` in-process (one process) or on N launched
workers. `fit` reads top to bottom: build, resume, epochs of train + exact evaluation +
checkpoint, outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import __version__, data as datasets, dist, models
from .checkpoint import load_file, save_file
from .config import TrainConfig
from .errors import UsageError
from .launcher import launch, parse_nproc
from .plots import plot_curves
from .runtime import Runtime, resolve_device
from .strategy import unwrap

KEEP_CHECKPOINTS = 2


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Validate, then run `fit` on this process or on `--nproc` local workers."""
    t0 = time.time()
    # Filled here, not in the config: there None means "not given", which --resume auto checks.
    cfg = dataclasses.replace(cfg, out=cfg.out or time.strftime("runs/%Y%m%d-%H%M%S"))
    device = resolve_device(cfg.device, bind=False)  # UsageError for --device cuda without a GPU
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise UsageError(f"--out {cfg.out}: exists and is not a directory")
    resume = resume_path(cfg)  # a bad --resume fails here, before any worker starts
    if dist.detect_env().source != "single":  # under torchrun / srun: this process is one worker
        return fit(cfg, t0, resume)
    nproc = _nproc(cfg, device.type)
    if nproc == 1:
        return fit(cfg, t0, resume)
    return launch(fit, cfg, t0, resume, nproc=nproc, device=device.type)[0]


def _nproc(cfg: TrainConfig, device_type: str) -> int:
    one_process = cfg.strategy in ("dp", "single")
    nproc = 1 if one_process and cfg.nproc == "auto" else parse_nproc(cfg.nproc, device_type)
    if one_process and nproc > 1:
        raise UsageError(f"--strategy {cfg.strategy} runs one process; drop --nproc {nproc} or use --strategy ddp")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} is more than the {torch.cuda.device_count()} visible GPUs")
    try:
        datasets.per_rank_batch(cfg.batch_size, nproc)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return nproc


def resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: `--resume PATH` (checked), or with `--resume auto` the
    newest usable one in `--out`/checkpoints (None when there is none yet)."""
    if cfg.resume is None:
        return None
    if cfg.resume != "auto":
        try:
            check_resumable(cfg.resume, cfg)
        except UsageError as err:
            raise UsageError(f"--resume: {err}") from None
        return cfg.resume
    folder = os.path.join(cfg.out, "checkpoints")
    names = sorted(n for n in os.listdir(folder) if n.startswith("epoch-") and n.endswith(".pt")) \
        if os.path.isdir(folder) else []
    for name in reversed(names):  # newest first; temp files of an interrupted write never match
        path = os.path.join(folder, name)
        try:
            check_resumable(path, cfg)
            return path
        except UsageError:
            continue
    return None


def check_resumable(path: str, cfg: TrainConfig) -> None:
    """Raise UsageError unless `path` is a readable training checkpoint that this config can
    continue: same model, optimizer and dataset, and epochs left to run."""
    state = load_file(path)  # missing, truncated, corrupt or code-carrying files stop here
    need = ("model", "optimizer", "scheduler", "loader", "run")
    missing = [k for k in need if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path}: not a ddpkit training checkpoint (no {', '.join(missing)})")
    run = state["run"]
    for key in ("model", "optimizer", "data"):
        if run.get(key) != getattr(cfg, key):
            raise UsageError(f"checkpoint {path}: was trained with --{key} {run.get(key)}; "
                             f"this run has --{key} {getattr(cfg, key)}")
    if run["epoch"] >= cfg.epochs:
        raise UsageError(f"checkpoint {path}: already at epoch {run['epoch']}; raise --epochs above it to continue")
    model = models.build(cfg.model, *datasets.shape_of(cfg.data, cfg.shape(), cfg.num_classes))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise UsageError(f"checkpoint {path}: its weights do not fit --model {cfg.model} ({first})") from None


def _optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)


def fit(cfg: TrainConfig, t0: float, resume: str | None = None) -> dict[str, Any]:
    """One worker's whole run. Every rank returns the same results dict."""
    with Runtime(cfg.strategy, cfg.precision, cfg.device, seed=cfg.seed, timeout_s=cfg.timeout) as rt:
        # Under torchrun each rank ran train() and its own clock: rank 0's defaults win.
        cfg, resume = rt.broadcast_object((cfg, resume))
        splits = datasets.load(cfg.data, synthetic_shape=cfg.shape(), synthetic_size=cfg.synthetic_size,
                               num_classes=cfg.num_classes, seed=cfg.seed)
        model = models.build(cfg.model, splits.in_shape, splits.num_classes)
        model, opt = rt.setup(model, _optimizer(cfg, model.parameters()))
        train_loader = rt.loader(splits.train, cfg.batch_size, num_workers=cfg.num_workers)
        test_loader = rt.eval_loader(splits.test, cfg.eval_batch_size, num_workers=cfg.num_workers)
        total_steps = cfg.epochs * len(train_loader)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * k / total_steps)))
        run = RunState(cfg)
        if resume is not None:
            run.restore(rt.load(resume, model=model, optimizer=opt, scheduler=sched, precision=rt.precision,
                                loader=train_loader))
            rt.print(f"resumed from {resume} at epoch {run.epoch}")
        rt.print(f"ddpkit train: {cfg.model} on {cfg.data} ({len(splits.train)} train / {len(splits.test)} test), "
                 f"{rt.world_size} x {rt.device.type} {rt.strategy}, global batch {cfg.batch_size}, {cfg.precision}")
        with Outputs(cfg, rt.is_main, resumed_step=run.step if resume else None) as out:
            train_time = 0.0
            for epoch in range(run.epoch, cfg.epochs):
                t_epoch = time.perf_counter()
                loss, acc = _train_epoch(rt, cfg, model, opt, sched, train_loader, run, out, epoch)
                train_time += time.perf_counter() - t_epoch
                _end_epoch(rt, cfg, model, test_loader, run, out, epoch, time.perf_counter() - t_epoch, loss, acc)
                rt.save(out.checkpoint_path(run.epoch), model=model, optimizer=opt, scheduler=sched,
                        precision=rt.precision, loader=train_loader, run=run.state_dict())
                out.prune_checkpoints()
            samples = (cfg.epochs - run.start_epoch) * len(splits.train)
            results = _results(cfg, rt, run, len(splits.train), samples / train_time, time.time() - t0)
            out.finish(results, model, run.history)
        rt.print(out.summary(results))
        rt.barrier()
        return results


def _train_epoch(rt: Runtime, cfg: TrainConfig, model: Any, opt: Any, sched: Any, loader: Any,
                 run: "RunState", out: "Outputs", epoch: int) -> tuple[float, float]:
    """One pass over the training set; returns the loss and accuracy averaged per sample over
    all ranks. Per-step values stay on the device: one all-reduce at the end, not one per step."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    correct = torch.zeros((), dtype=torch.float64, device=rt.device)
    count = 0
    batches = out.progress(loader, epoch)
    t_log = time.perf_counter()
    for x, y in batches:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        rt.backward(loss)
        rt.step(opt)
        sched.step()
        run.step += 1
        loss_sum += loss.detach().double() * y.numel()
        correct += (logits.argmax(1) == y).sum()
        count += y.numel()
        if run.step % cfg.log_every == 0:  # every rank: the loss is averaged over them
            now = time.perf_counter()
            step_loss = rt.all_reduce(loss.detach().double(), op="mean").item()
            rate = cfg.log_every * cfg.batch_size / max(now - t_log, 1e-9)
            t_log = now
            out.log({"type": "step", "epoch": epoch + 1, "step": run.step, "loss": step_loss,
                     "lr": sched.get_last_lr()[0], "samples_per_second": rate})
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(loss=f"{step_loss:.4f}", samples_s=f"{rate:,.0f}")
    sums = rt.all_reduce(torch.stack([loss_sum, correct, torch.tensor(float(count), dtype=torch.float64,
                                                                       device=rt.device)]))
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()


def _end_epoch(rt: Runtime, cfg: TrainConfig, model: Any, test_loader: Any, run: "RunState", out: "Outputs",
               epoch: int, seconds: float, loss: float, acc: float) -> None:
    ev = rt.evaluate(model, test_loader)
    record = {"type": "epoch", "epoch": epoch + 1, "step": run.step, "train_loss": loss,
              "train_accuracy": acc, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
              "test_samples": ev["samples"], "epoch_seconds": seconds}
    run.history.append(record)
    run.epoch = epoch + 1
    out.log(record)
    rt.print(f"epoch {epoch + 1:>3}/{cfg.epochs}  train loss {loss:.4f}  acc {acc:.4f}  |  "
             f"test loss {ev['loss']:.4f}  acc {ev['accuracy']:.4f}  ({ev['samples']} samples)")


def _results(cfg: TrainConfig, rt: Runtime, run: "RunState", train_samples: int, rate: float,
             wall: float) -> dict[str, Any]:
    last = run.history[-1]
    return {
        "test_accuracy": last["test_accuracy"], "test_loss": last["test_loss"],
        "test_samples": last["test_samples"], "train_samples": train_samples,
        "world_size": rt.world_size, "global_batch_size": cfg.batch_size, "epochs": cfg.epochs,
        "steps": run.step, "final_train_loss": last["train_loss"], "final_train_accuracy": last["train_accuracy"],
        "samples_per_second": rate, "wall_seconds": wall,
        "device": rt.device.type, "strategy": rt.strategy, "precision": cfg.precision, "seed": cfg.seed,
        "model": cfg.model, "data": cfg.data, "resumed_from_epoch": run.start_epoch,
        "ddpkit_version": __version__, "torch_version": torch.__version__,
    }


class RunState:
    """Loop counters, history and random states: what a checkpoint holds besides the model,
    optimizer, scheduler, scaler and loader. Also records what it was trained with."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.epoch = self.step = self.start_epoch = 0
        self.history: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state()
        return {
            "epoch": self.epoch, "step": self.step, "history": self.history,
            "model": self.cfg.model, "optimizer": self.cfg.optimizer, "data": self.cfg.data,
            # weights_only loading accepts tensors and plain containers, not NumPy arrays
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["run"]
        self.epoch = self.start_epoch = int(state["epoch"])
        self.step = int(state["step"])
        self.history = list(state["history"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(_as_tuples(rng["python"]))
        kind, keys, *rest = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
        if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the tuples that torch.save stores and loads back as they were;
    # be lenient should a list come back.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class Outputs:
    """Everything `ddpkit train --out DIR` leaves; written by rank 0 only."""

    def __init__(self, cfg: TrainConfig, is_main: bool, resumed_step: int | None = None):
        self.cfg, self.is_main, self.dir = cfg, is_main, cfg.out
        self._metrics = None
        if not is_main:
            return
        os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        path = os.path.join(self.dir, "metrics.jsonl")
        kept = _records_until(path, resumed_step) if resumed_step is not None else []
        self._metrics = open(path, "w", buffering=1)
        self._metrics.writelines(kept)  # a resumed run drops what came after its checkpoint
        _write_yaml(os.path.join(self.dir, "config.yaml"), cfg.to_dict())

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._metrics is not None:
            self._metrics.close()

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")

    def progress(self, loader: Any, epoch: int) -> Any:
        if not (self.is_main and self.cfg.progress and sys.stderr.isatty()):
            return loader
        from tqdm.auto import tqdm

        return tqdm(loader, desc=f"epoch {epoch + 1}/{self.cfg.epochs}", unit="batch", leave=False)

    def checkpoint_path(self, epoch: int) -> str:
        return os.path.join(self.dir, "checkpoints", f"epoch-{epoch:04d}.pt")

    def prune_checkpoints(self) -> None:
        if not self.is_main:
            return
        folder = os.path.join(self.dir, "checkpoints")
        names = sorted(n for n in os.listdir(folder) if n.startswith("epoch-") and n.endswith(".pt"))
        for name in names[:-KEEP_CHECKPOINTS]:
            os.unlink(os.path.join(folder, name))

    def finish(self, results: dict[str, Any], model: Any, history: list[dict[str, Any]]) -> None:
        if not self.is_main:
            return
        save_file(os.path.join(self.dir, "model.pt"), unwrap(model).state_dict())
        with open(os.path.join(self.dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        plot_curves(history, os.path.join(self.dir, "curves.png"), title=f"{self.cfg.model} on {self.cfg.data}")

    def summary(self, r: dict[str, Any]) -> str:
        return (f"done: test accuracy {r['test_accuracy']:.4f} on {r['test_samples']} samples | "
                f"{r['steps']} steps, {r['samples_per_second']:,.0f} samples/s on {r['world_size']} x {r['device']} | "
                f"{r['wall_seconds']:.1f} s | outputs in {self.dir}")


def _records_until(path: str, step: int) -> list[str]:
    """Lines of an existing metrics.jsonl whose step is at most `step`."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]


def _write_yaml(path: str, mapping: dict[str, Any]) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(mapping, f, sort_keys=False)
