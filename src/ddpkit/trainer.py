"""The built-in training loop behind `ddpkit train`, on top of `Runtime`.

`train(cfg)` runs in the parent: it checks what can be checked before any process starts,
then either runs `fit` in-process (one process) or launches `fit` on N workers. `fit` reads top
to bottom: build, (resume), epochs of train + exact evaluation + checkpoint, then outputs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from . import __version__, data as datasets, dist, models
from .checkpoint import load_file
from .config import TrainConfig
from .errors import UsageError
from .launcher import launch, parse_nproc
from .runtime import Runtime, resolve_device

KEEP_CHECKPOINTS = 2


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Validate, then run `fit` on this process or on `--nproc` local workers."""
    t0 = time.time()
    env = dist.detect_env()
    device = resolve_device(cfg.device, bind=False)  # raises UsageError for --device cuda without a GPU
    if env.is_distributed:  # already under torchrun / srun: this process is one worker
        return fit(cfg, t0)
    nproc = 1 if cfg.strategy in ("dp", "single") and cfg.nproc == "auto" else parse_nproc(cfg.nproc, device.type)
    if cfg.strategy in ("dp", "single") and nproc > 1:
        raise UsageError(f"--strategy {cfg.strategy} runs one process; drop --nproc {nproc} or use --strategy ddp")
    try:
        datasets.per_rank_batch(cfg.batch_size, nproc)
    except ValueError as err:
        raise UsageError(str(err)) from None
    resume_path(cfg)  # a bad --resume fails here, before any worker starts
    if nproc == 1:
        return fit(cfg, t0)
    return launch(fit, cfg, t0, nproc=nproc, device=device.type)[0]


def resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: `--resume PATH` (checked readable), or with `--resume
    auto` the newest readable one in `--out`/checkpoints (None if there is none yet)."""
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
    """Raise UsageError unless `path` is a readable training checkpoint whose weights fit the
    configured model. Checked in the parent, so a bad file never reaches the workers."""
    state = load_file(path)  # missing, truncated, corrupt or code-carrying files stop here
    missing = [k for k in ("model", "optimizer", "scheduler", "loader", "run") if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path}: not a ddpkit training checkpoint (no {', '.join(missing)})")
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


def fit(cfg: TrainConfig, t0: float) -> dict[str, Any]:
    """One worker's whole run. Every rank returns the same results dict."""
    with Runtime(cfg.strategy, cfg.precision, cfg.device, seed=cfg.seed, timeout_s=cfg.timeout) as rt:
        splits = datasets.load(cfg.data, synthetic_shape=cfg.shape(), synthetic_size=cfg.synthetic_size,
                               num_classes=cfg.num_classes, seed=cfg.seed)
        model = models.build(cfg.model, splits.in_shape, splits.num_classes)
        model, opt = rt.setup(model, _optimizer(cfg, model.parameters()))
        train_loader = rt.loader(splits.train, cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_workers)
        test_loader = rt.eval_loader(splits.test, cfg.eval_batch_size, num_workers=cfg.num_workers)
        total_steps = cfg.epochs * len(train_loader)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 * (1 + math.cos(math.pi * k / total_steps)))
        run = RunState()
        if (path := resume_path(cfg)) is not None:
            run.restore(rt.load(path, model=model, optimizer=opt, scheduler=sched, precision=rt.precision,
                                loader=train_loader))
            rt.print(f"resumed from {path} at epoch {run.epoch}")
        out = Outputs(cfg, rt.is_main)
        rt.print(f"ddpkit train: {cfg.model} on {cfg.data} ({len(splits.train)} train / {len(splits.test)} test), "
                 f"{rt.world_size} x {rt.device.type} {rt.strategy}, global batch {cfg.batch_size}, {cfg.precision}")
        train_time = 0.0
        for epoch in range(run.epoch, cfg.epochs):
            t_epoch = time.perf_counter()
            loss, acc = _train_epoch(rt, cfg, model, opt, sched, train_loader, run, out, epoch)
            train_time += time.perf_counter() - t_epoch
            ev = rt.evaluate(model, test_loader)
            record = {"type": "epoch", "epoch": epoch + 1, "step": run.step, "train_loss": loss,
                      "train_accuracy": acc, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                      "test_samples": ev["samples"], "epoch_seconds": time.perf_counter() - t_epoch}
            run.history.append(record)
            out.log(record)
            rt.print(f"epoch {epoch + 1:>3}/{cfg.epochs}  train loss {loss:.4f}  acc {acc:.4f}  |  "
                     f"test loss {ev['loss']:.4f}  acc {ev['accuracy']:.4f}  ({ev['samples']} samples)")
            run.epoch = epoch + 1
            rt.save(out.checkpoint_path(run.epoch), model=model, optimizer=opt, scheduler=sched,
                    precision=rt.precision, loader=train_loader, run=run.state_dict())
            out.prune_checkpoints()
        last = run.history[-1]
        samples = (cfg.epochs - run.start_epoch) * len(splits.train)
        results = {
            "test_accuracy": last["test_accuracy"], "test_loss": last["test_loss"],
            "test_samples": last["test_samples"], "train_samples": len(splits.train),
            "world_size": rt.world_size, "global_batch_size": cfg.batch_size, "epochs": cfg.epochs,
            "steps": run.step, "final_train_loss": last["train_loss"],
            "final_train_accuracy": last["train_accuracy"],
            "samples_per_second": samples / train_time if train_time > 0 else None,
            "train_seconds": train_time, "wall_seconds": time.time() - t0,
            "device": str(rt.device.type), "strategy": rt.strategy, "precision": cfg.precision,
            "seed": cfg.seed, "model": cfg.model, "data": cfg.data, "resumed_from_epoch": run.start_epoch,
            "ddpkit_version": __version__, "torch_version": torch.__version__,
        }
        out.finish(results, model, run.history)
        rt.print(out.summary(results))
        rt.barrier()
        return results


def _train_epoch(rt: Runtime, cfg: TrainConfig, model: Any, opt: Any, sched: Any, loader: Any,
                 run: "RunState", out: "Outputs", epoch: int) -> tuple[float, float]:
    """One pass over the training set; returns the loss and accuracy averaged per sample over
    all ranks. Per-step values stay on the device: one all-reduce at the end, not one per step."""
    model.train()
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss * n, correct, n
    batches = out.progress(loader, epoch)
    t_log = time.perf_counter()
    for x, y in batches:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        rt.backward(loss)
        rt.step(opt)
        sched.step()
        run.step += 1
        n = y.numel()
        sums += torch.stack([loss.detach().double() * n, (logits.argmax(1) == y).sum().double(),
                             torch.tensor(float(n), dtype=torch.float64, device=rt.device)])
        if run.step % cfg.log_every == 0 and rt.is_main:
            now = time.perf_counter()
            rate = cfg.log_every * cfg.batch_size / max(now - t_log, 1e-9)
            t_log = now
            value = loss.item()
            out.log({"type": "step", "epoch": epoch + 1, "step": run.step, "loss": value,
                     "lr": sched.get_last_lr()[0], "samples_per_second": rate})
            if hasattr(batches, "set_postfix"):
                batches.set_postfix(loss=f"{value:.4f}", samples_s=f"{rate:,.0f}")
    rt.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()


class RunState:
    """Loop counters and history: what a checkpoint needs besides model/optimizer/loader."""

    def __init__(self) -> None:
        self.epoch = self.step = self.start_epoch = 0
        self.history: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "history": self.history,
                "torch_rng": torch.get_rng_state()}

    def restore(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["run"]
        self.epoch = self.start_epoch = int(state["epoch"])
        self.step = int(state["step"])
        self.history = list(state["history"])
        torch.set_rng_state(state["torch_rng"].cpu())


class Outputs:
    """Everything `ddpkit train --out DIR` leaves; written by rank 0 only."""

    def __init__(self, cfg: TrainConfig, is_main: bool):
        self.cfg, self.is_main, self.dir = cfg, is_main, cfg.out
        if is_main:
            os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
            mode = "a" if cfg.resume else "w"
            self._metrics = open(os.path.join(self.dir, "metrics.jsonl"), mode, buffering=1)
            _write_yaml(os.path.join(self.dir, "config.yaml"), cfg.to_dict())

    def log(self, record: dict[str, Any]) -> None:
        if self.is_main:
            self._metrics.write(json.dumps(record) + "\n")

    def progress(self, loader: Any, epoch: int) -> Any:
        show = self.is_main and self.cfg.progress and sys.stderr.isatty()
        if not show:
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
        from .checkpoint import save_file
        from .plots import plot_curves
        from .strategy import unwrap

        save_file(os.path.join(self.dir, "model.pt"), unwrap(model).state_dict())
        with open(os.path.join(self.dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        plot_curves(history, os.path.join(self.dir, "curves.png"), title=f"{self.cfg.model} on {self.cfg.data}")
        self._metrics.close()

    def summary(self, r: dict[str, Any]) -> str:
        rate = f"{r['samples_per_second']:,.0f}" if r["samples_per_second"] else "n/a"
        return (f"done: test accuracy {r['test_accuracy']:.4f} on {r['test_samples']} samples | "
                f"{r['steps']} steps, {rate} samples/s on {r['world_size']} x {r['device']} | "
                f"{r['wall_seconds']:.1f} s | outputs in {self.dir}")


def _write_yaml(path: str, mapping: dict[str, Any]) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(mapping, f, sort_keys=False)
