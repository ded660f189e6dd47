"""The built-in training loop behind `ddpkit train`, on top of `Runtime`.

`train(cfg)` runs in the parent: it checks everything that can be checked before a process
starts (bad input exits 2 there), then runs `fit` in-process (one process) or on N launched
workers. `fit` reads top to bottom: build, resume, epochs of train + exact evaluation +
checkpoint, outputs.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import __version__, data as datasets, dist, models
from .checkpoint import load_file, save_file
from .config import TrainConfig
from .errors import IncompatibleCheckpoint, UsageError
from .launcher import Nodes, launch, parse_nproc
from .metrics import GpuUtilization, StepTimer, flops_per_sample, peak_memory_mib, peak_tflops
from .plots import plot_curves
from .runtime import Runtime, resolve_device, seed_rank
from .strategy import unwrap


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Validate, then run `fit` on this process or on `--nproc` local workers."""
    t0 = time.time()
    # Filled here, not in the config: there None means "not given", which --resume auto checks.
    cfg = dataclasses.replace(cfg, out=cfg.out or time.strftime("runs/%Y%m%d-%H%M%S"))
    device = resolve_device(cfg.device, bind=False)  # UsageError for --device cuda without a GPU
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise UsageError(f"--out {cfg.out}: exists and is not a directory")
    if cfg.sync_batchnorm and device.type != "cuda":
        raise UsageError("--sync-batchnorm needs --device cuda: torch's SyncBatchNorm runs on GPUs only")
    if cfg.sync_batchnorm and cfg.micro_batch_size:
        # SyncBatchNorm all-reduces in every forward; ranks may run different numbers of them.
        raise UsageError("--sync-batchnorm cannot be combined with --micro-batch-size")
    if cfg.comm_hook == "bf16" and device.type != "cuda":
        raise UsageError("--comm-hook bf16 needs CUDA GPUs: torch allows its bf16 hook only with NCCL; "
                         "use --comm-hook fp16 on CPU")
    if cfg.precision == "fp16" and device.type == "cpu":
        # Measured by `ddpkit bench precision`: tens of times slower than fp32 on CPUs.
        print("ddpkit train: warning: --precision fp16 on CPU is usually much slower than fp32 (few CPUs have fast "
              "fp16 kernels); bf16 is faster on CPUs with native bf16 (AVX-512 BF16, AMX)", file=sys.stderr)
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]'")
    resume = resume_path(cfg)  # a bad --resume fails here, before any worker starts
    if cfg.resume is None and checkpoint_names(os.path.join(cfg.out, "checkpoints")) and not restarted():
        # A fresh run here would prune the old run's checkpoints as its own and leave a mix.
        raise UsageError(f"--out {cfg.out} already holds a run's checkpoints: continue it with --resume auto, "
                         f"or choose another --out")
    # Download and check dataset files here, once, so workers only read them. (Under torchrun
    # every worker gets here: downloads are temp file + rename, so concurrent ones are safe.)
    datasets.prepare(cfg.data, cfg.data_dir)
    env = dist.detect_env()
    if env.source != "single":  # under torchrun / srun: this process is one worker
        _check_allocation(cfg, env, device)
        _check_out_dir(cfg.out)
        return fit(cfg, t0, resume)
    nodes = Nodes(cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port)
    nproc = _nproc(cfg, device.type, nodes.range()[0])
    _check_out_dir(cfg.out)  # last: rejected input leaves no folder behind
    if nproc == 1 and cfg.max_restarts == 0 and nodes.range()[1] == 1:
        return fit(cfg, t0, resume)  # no agent needed: nothing to restart, no one to coordinate
    results = launch(fit, cfg, t0, resume, nproc=nproc, device=device.type, max_restarts=cfg.max_restarts,
                     nodes=nodes)
    return next(iter(results.values()))  # every rank returns the same results


def _check_out_dir(path: str) -> None:
    """Create --out now and prove it writable, rather than fail on rank 0 after the data and
    the model are built."""
    try:
        os.makedirs(os.path.join(path, "checkpoints"), exist_ok=True)
        # A file of its own: under torchrun or srun every rank runs this check at once.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tmp-write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"--out {path}: cannot write there ({err.strerror})") from None


def _check_allocation(cfg: TrainConfig, env: dist.DistEnv, device: torch.device) -> None:
    """Under srun or torchrun the processes already exist: flags asking for others are a
    mismatch, reported now rather than discovered as a hang at the first collective."""
    launcher = "srun" if env.source == "slurm" else "torchrun"
    if cfg.nproc not in ("auto", "1") or cfg.nnodes != "1" or cfg.max_restarts:
        raise UsageError(f"under {launcher} each process is one worker ({env.world_size} in all): drop --nproc, "
                         f"--nnodes and --max-restarts and size the job with {launcher}'s own options")
    if device.type == "cuda" and torch.cuda.device_count() > 1 and env.local_world_size > torch.cuda.device_count():
        raise UsageError(f"{launcher} started {env.local_world_size} processes on this node but only "
                         f"{torch.cuda.device_count()} GPUs are visible")
    try:
        datasets.check_global_batch(cfg.batch_size, env.world_size)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _nproc(cfg: TrainConfig, device_type: str, min_nodes: int = 1) -> int:
    one_process = cfg.strategy in ("dp", "single")
    nproc = 1 if one_process and cfg.nproc == "auto" else parse_nproc(cfg.nproc, device_type)
    if one_process and nproc > 1:
        raise UsageError(f"--strategy {cfg.strategy} runs one process; drop --nproc {nproc} or use --strategy ddp")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc} is more than the {torch.cuda.device_count()} visible GPUs")
    try:
        datasets.check_global_batch(cfg.batch_size, nproc * min_nodes)  # every node's processes
    except ValueError as err:
        raise UsageError(str(err)) from None
    return nproc


def resume_path(cfg: TrainConfig, allow_finished: bool = False) -> str | None:
    """The checkpoint to resume from: `--resume PATH` (checked), or with `--resume auto` the
    newest usable one in `--out`/checkpoints (None when there is none yet). `allow_finished`
    accepts a checkpoint of the last epoch (a restart after training, before the outputs)."""
    if cfg.resume is None:
        return None
    if cfg.resume != "auto":
        try:
            check_resumable(cfg.resume, cfg)
        except UsageError as err:
            raise UsageError(f"--resume: {err}") from None
        return cfg.resume
    folder = os.path.join(cfg.out, "checkpoints")
    for name in reversed(checkpoint_names(folder)):  # newest first; temp files of an interrupted write never match
        path = os.path.join(folder, name)
        try:
            check_resumable(path, cfg, allow_finished)
            return path
        except IncompatibleCheckpoint as err:
            # Starting afresh here would overwrite the run's metrics and checkpoints.
            raise UsageError(f"--resume auto: {err}") from None
        except UsageError:
            continue  # damaged (a crash mid-write, a full disk): fall back to an older one
    return None


def check_resumable(path: str, cfg: TrainConfig, allow_finished: bool = False) -> None:
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
            flag = "--" + key.replace("_", "-")
            raise IncompatibleCheckpoint(f"checkpoint {path}: was trained with {flag} {run[key]}; "
                                         f"this run has {flag} {getattr(cfg, key)}")
    if run["epoch"] >= cfg.epochs and not (allow_finished and run["epoch"] == cfg.epochs):
        raise IncompatibleCheckpoint(f"checkpoint {path}: the run already finished its {run['epoch']} epochs; "
                                     f"raise --epochs to continue it")
    model = models.build(cfg.model, *datasets.shape_of(cfg.data, cfg.shape(), cfg.num_classes))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise IncompatibleCheckpoint(f"checkpoint {path}: its weights do not fit --model {cfg.model} ({first})") from None


# The optimizer's and scheduler's saved state would silently override a changed --lr,
# --weight-decay or scaling, so those must match too. --epochs may grow (that is how a finished
# run continues); the cosine schedule then stretches over the new total.
RESUME_MUST_MATCH = ("model", "optimizer", "data", "batch_size", "seed", "num_classes", "synthetic_shape",
                     "synthetic_size", "lr", "weight_decay", "lr_scaling", "reference_batch_size", "warmup_epochs",
                     "augment", "crop_padding", "label_smoothing", "momentum")


def _optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    lr = cfg.peak_lr()
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                           weight_decay=cfg.weight_decay)


def schedule(cfg: TrainConfig, steps_per_epoch: int) -> Any:
    """LR factor per optimizer step: linear warmup over --warmup-epochs, then cosine to zero.

    As in Goyal et al., "Accurate, Large Minibatch SGD": warmup starts from the reference LR
    (the peak divided by the scaling factor) and climbs to the scaled peak; without scaling it
    starts from zero. Depends on steps, not processes, like everything else in the run.
    """
    total = cfg.epochs * steps_per_epoch
    warmup = min(total, round(cfg.warmup_epochs * steps_per_epoch))
    scale = cfg.peak_lr() / cfg.lr
    start = 1.0 / scale if scale > 1 else 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return start + (1.0 - start) * step / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def fit(cfg: TrainConfig, t0: float, resume: str | None = None) -> dict[str, Any]:
    """One worker's whole run. Every rank returns the same results dict."""
    with Runtime(cfg.strategy, cfg.precision, cfg.device, seed=cfg.seed, timeout_s=cfg.timeout,
                 channels_last=cfg.channels_last, compile=cfg.compile, ddp=cfg.ddp_options()) as rt:
        if restarted() and rt.is_main:
            # The elastic agent restarted us after a worker died: carry on from the newest
            # complete checkpoint, whatever the command line said.
            resume = resume_path(dataclasses.replace(cfg, resume="auto"), allow_finished=True) or resume
        # Under torchrun each rank ran train() and its own clock: rank 0's choices win.
        cfg, resume = rt.broadcast_object((cfg, resume))
        loop = Loop(rt, cfg)  # rt.setup() inside gives each rank its own random stream
        if resume is not None:
            loop.restore(resume)
        rt.print(f"ddpkit train: {cfg.model} on {cfg.data} ({len(loop.splits.train)} train / "
                 f"{len(loop.splits.test)} test), {rt.world_size} x {rt.device.type} {rt.strategy}, "
                 f"global batch {cfg.batch_size}, {cfg.precision}")
        with Outputs(cfg, rt.is_main, resumed_step=(loop.run.step, loop.run.epoch) if resume else None) as out:
            results = loop.run_all(out, t0)
        rt.print(out.summary(results))
        dist.wait_for_main()  # rank 0 wrote model.pt, results.json and the plot alone
        return results


def restarted() -> int:
    """How many times the elastic agent has restarted this job's workers (0 on the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Loop:
    """The built-in loop's parts, built once per worker: data, model, optimizer, schedule."""

    def __init__(self, rt: Runtime, cfg: TrainConfig):
        self.rt, self.cfg = rt, cfg
        self.splits = datasets.load(cfg.data, data_dir=cfg.data_dir, synthetic_shape=cfg.shape(),
                                    synthetic_size=cfg.synthetic_size,
                                    num_classes=cfg.num_classes, seed=cfg.seed)
        if isinstance(self.splits.train, datasets.ImageSet):
            self.splits.train.augment = datasets.Augment.parse(cfg.augment, cfg.crop_padding)
        model = models.build(cfg.model, self.splits.in_shape, self.splits.num_classes)
        if cfg.sync_batchnorm and rt.world_size > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model, self.opt = rt.setup(model, _optimizer(cfg, model.parameters()))
        self.train_loader = rt.loader(self.splits.train, cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
                                      num_workers=cfg.num_workers, resident=cfg.resident())
        self.test_loader = rt.eval_loader(self.splits.test, cfg.eval_batch_size, num_workers=cfg.num_workers,
                                          resident=cfg.resident())
        self.timer = StepTimer(rt.device)
        self.gpu_util: GpuUtilization | None = None
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule(cfg, self.train_loader.steps_per_epoch))
        self.run = RunState(cfg, rt.device, self.train_loader.generator)
        self.samples = 0  # trained on by this process's run, all ranks together
        # First step whose loss was not finite, on this rank (-1: none). Kept on the device and
        # compared there, so watching for NaN costs no synchronization per step.
        self.first_bad = torch.full((), -1, dtype=torch.long, device=rt.device)
        self.step_t = torch.zeros((), dtype=torch.long, device=rt.device)
        self.bad_now = torch.zeros((), dtype=torch.bool, device=rt.device)  # this step, --on-nonfinite skip

    def restore(self, path: str) -> None:
        state = self.rt.load(path, model=self.model, optimizer=self.opt, scheduler=self.sched,
                             precision=self.rt.precision, loader=self.train_loader)
        self.run.restore(state, self.rt)
        self.step_t.fill_(self.run.step)
        self.rt.print(f"resumed from {path} at step {self.run.step} (epoch {self.run.epoch + 1}, "
                      f"step {self.train_loader.position} of {self.train_loader.steps_per_epoch})")

    def stopped(self) -> bool:
        return self.cfg.max_steps is not None and self.run.step >= self.cfg.max_steps

    def run_all(self, out: "Outputs", t0: float) -> dict[str, Any]:
        train_time = 0.0
        self.gpu_util = GpuUtilization(self.rt.device) if self.rt.is_main else None
        while self.run.epoch < self.cfg.epochs and not self.stopped():
            t_epoch = time.perf_counter()
            done = self.train_epoch(out)
            train_time += time.perf_counter() - t_epoch
            if done:
                self.end_epoch(out, time.perf_counter() - t_epoch)
            self.save(out)
        self.check_finite()
        ev = self.rt.evaluate(self.model, self.test_loader)
        rate = self.samples / max(train_time, 1e-9)
        results = self.results(ev, rate, time.time() - t0)
        results.update(self.performance(rate))
        out.finish(results, self.model, self.run.history)
        return results

    def train_epoch(self, out: "Outputs") -> bool:
        """Train until the epoch ends (True) or --max-steps is reached (False). The epoch's
        loss and accuracy sums stay on the device, summed per sample; one all-reduce at its end."""
        rt, cfg, run = self.rt, self.cfg, self.run
        self.model.train()
        step_loss = torch.zeros((), dtype=torch.float64, device=rt.device)
        batches = out.progress(self.train_loader, run.epoch)
        t_log = time.perf_counter()
        self.timer.start()
        for x, y in batches:
            n = self.train_loader.current.size
            try:
                logits = self.model(x)
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
            except torch.cuda.OutOfMemoryError:
                raise torch.cuda.OutOfMemoryError(self._oom_advice(n)) from None
            if n:
                bad = ~torch.isfinite(loss.detach())
                if cfg.on_nonfinite == "skip":
                    self.bad_now |= bad
                else:
                    self.first_bad = torch.where(bad & (self.first_bad < 0), self.step_t + 1, self.first_bad)
            rt.backward(loss)
            if n:
                # Per-sample sums; a skipped non-finite loss is left out of the epoch's mean.
                finite = torch.isfinite(loss.detach())
                run.sums[0] += torch.where(finite, loss.detach().double() * n, 0.0)
                run.sums[1] += (logits.argmax(1) == y).sum()
                run.sums[2] += finite * n
                step_loss += loss.detach().double() * n
            if cfg.on_nonfinite == "skip" and rt.step_ready and self._skip_step(out):
                pass  # no update on any rank: the step's data is spent, the schedule moves on
            elif not rt.step(self.opt):
                continue  # more micro-batches of this global batch to come
            self.sched.step()
            self.timer.mark(tuple(x.shape))
            run.step += 1
            self.step_t += 1
            self.samples += self.train_loader.current.step_size
            if run.step % cfg.log_every == 0:  # every rank: the loss is summed over all of them
                self.check_finite()
                now = time.perf_counter()
                value = rt.all_reduce(step_loss).item() / self.train_loader.current.step_size
                rate = cfg.log_every * cfg.batch_size / max(now - t_log, 1e-9)
                t_log = now
                out.log({"type": "step", "epoch": run.epoch + 1, "step": run.step, "loss": value,
                         "lr": self.sched.get_last_lr()[0], "samples_per_second": rate})
                if hasattr(batches, "set_postfix"):
                    batches.set_postfix(loss=f"{value:.4f}", samples_s=f"{rate:,.0f}")
            step_loss.zero_()
            if self.stopped() and self.train_loader.position < self.train_loader.steps_per_epoch:
                return False  # stopped inside the epoch; at its last step the loop ends it as usual
            if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                self.save(out)
        return True

    def _skip_step(self, out: "Outputs") -> bool:
        """True (and the gradients dropped) if any rank saw a non-finite loss in this step.
        Collective: one scalar all-reduce per step, paid only with --on-nonfinite skip."""
        bad = self.rt.all_reduce(self.bad_now.double(), op="max").item() > 0
        self.bad_now.zero_()
        if bad:
            self.opt.zero_grad(set_to_none=True)
            self.run.skipped += 1
            out.log({"type": "skip", "epoch": self.run.epoch + 1, "step": self.run.step + 1,
                     "reason": "non-finite loss"})
        return bad

    def _oom_advice(self, n: int) -> str:
        micro = max(1, n // 2)
        return (f"CUDA out of memory on rank {self.rt.rank} with {n} samples per forward (global batch "
                f"{self.cfg.batch_size} over {self.rt.world_size} processes). The global batch can stay: add "
                f"--micro-batch-size {micro} to accumulate gradients over smaller forwards (same result), "
                f"or use --precision bf16")

    def check_finite(self) -> None:
        """Stop the run, on every rank alike, if any rank has seen a non-finite loss (naming the
        first step and the rank(s)) or the weights are no longer finite. Collective; runs at log
        steps and before anything is saved, so no file ever holds weights trained on NaN."""
        firsts = [int(t) for t in self.rt.all_gather(self.first_bad.view(1))]
        seen = [f for f in firsts if f >= 0]
        if not seen:
            params_ok = torch.stack([p.detach().isfinite().all() for p in self.model.parameters()]).all()
            if self.rt.all_reduce(params_ok.double(), op="min").item() < 1:
                raise FloatingPointError(f"the weights hold NaN or inf after step {self.run.step}; stopped before "
                                         f"saving them. Try a lower --lr or --warmup-epochs")
        if seen:
            step = min(seen)
            ranks = ", ".join(str(r) for r, f in enumerate(firsts) if f == step)
            hint = "a lower --lr or --warmup-epochs" + (", or --precision fp32" if self.cfg.precision != "fp32" else "")
            raise FloatingPointError(f"non-finite training loss at step {step} on rank {ranks} (peak lr "
                                     f"{self.cfg.peak_lr():g}); stopped before saving it. Try {hint}")

    def end_epoch(self, out: "Outputs", seconds: float) -> None:
        rt, run = self.rt, self.run
        loss, correct, count = rt.all_reduce(run.sums.clone()).tolist()
        run.sums.zero_()
        count = count or float("nan")  # every step skipped: say so rather than divide by zero
        ev = rt.evaluate(self.model, self.test_loader)
        record = {"type": "epoch", "epoch": run.epoch + 1, "step": run.step, "train_loss": loss / count,
                  "train_accuracy": correct / count, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                  "test_samples": ev["samples"], "epoch_seconds": seconds, "lr": self.sched.get_last_lr()[0]}
        run.history.append(record)
        run.epoch += 1
        out.log(record)
        rt.print(f"epoch {run.epoch:>3}/{self.cfg.epochs}  train loss {loss / count:.4f}  acc {correct / count:.4f}"
                 f"  |  test loss {ev['loss']:.4f}  acc {ev['accuracy']:.4f}  ({ev['samples']} samples)")

    def save(self, out: "Outputs") -> None:
        """A checkpoint of everything the run needs to continue, on any number of processes.
        Collective: every rank calls it at the same step. Never saves weights trained on NaN."""
        self.check_finite()
        run_state = self.run.state_dict(self.rt)
        self.rt.save(out.checkpoint_path(self.run.step), model=self.model, optimizer=self.opt, scheduler=self.sched,
                     precision=self.rt.precision, loader=self.train_loader, run=run_state)
        out.prune_checkpoints()

    def performance(self, rate: float) -> dict[str, Any]:
        """Step-time percentiles (rank 0's; warm-up and compilation apart), peak memory of
        every rank, and on GPUs the model FLOP utilization and the GPU's own utilization.
        Collective: every rank calls it."""
        rt, cfg = self.rt, self.cfg
        timing = self.timer.summary()
        memory = [round(m, 1) for m in rt.gather_objects(peak_memory_mib(rt.device))]
        perf: dict[str, Any] = {**timing, "peak_memory_mib": memory,
                                "peak_memory_kind": "cuda_max_allocated" if rt.device.type == "cuda" else "rss"}
        if cfg.compile and "step_time_ms" in timing:
            # Warm-up steps cost a step plus the compilation of their shape.
            perf["compile_seconds"] = max(0.0, timing["warmup_seconds"]
                                          - timing["warmup_steps"] * timing["step_time_ms"]["p50"] / 1e3)
        flops = flops_per_sample(unwrap(self.model), self.splits.in_shape, rt.device) if rt.is_main else None
        flops = rt.broadcast_object(flops)
        perf["flops_per_sample"] = flops
        perf["achieved_tflops"] = flops * rate / 1e12 if flops else None
        peak = peak_tflops(rt.device, cfg.precision)
        perf["peak_tflops_per_device"] = peak
        # DataParallel runs one process over every visible GPU.
        devices = torch.cuda.device_count() if rt.strategy == "dp" else rt.world_size
        perf["mfu"] = perf["achieved_tflops"] / (peak * devices) if peak and flops else None
        util = self.gpu_util.stop() if self.gpu_util is not None else None
        perf["gpu_utilization_percent"] = rt.broadcast_object(util)
        return perf

    def results(self, ev: dict[str, Any], rate: float, wall: float) -> dict[str, Any]:
        cfg, run, rt = self.cfg, self.run, self.rt
        last = run.history[-1] if run.history else {}
        return {
            "test_accuracy": ev["accuracy"], "test_loss": ev["loss"], "test_samples": ev["samples"],
            "train_samples": len(self.splits.train), "world_size": rt.world_size,
            "global_batch_size": cfg.batch_size, "micro_batch_size": cfg.micro_batch_size, "epochs": cfg.epochs,
            "epochs_completed": run.epoch, "steps": run.step, "stopped_early": self.stopped() and run.epoch < cfg.epochs,
            "final_train_loss": last.get("train_loss"), "final_train_accuracy": last.get("train_accuracy"),
            "samples_per_second": rate, "wall_seconds": wall, "device": rt.device.type, "strategy": rt.strategy,
            "precision": cfg.precision, "seed": cfg.seed, "lr": cfg.lr, "peak_lr": cfg.peak_lr(),
            "model": cfg.model, "data": cfg.data, "resumed_from_step": run.start_step,
            "skipped_steps": run.skipped,
            "ddpkit_version": __version__, "torch_version": torch.__version__,
        }


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
            "epoch": self.epoch, "step": self.step, "history": self.history, "skipped": self.skipped,
            **{key: getattr(self.cfg, key) for key in RESUME_MUST_MATCH},
            "sums": rt.all_reduce(self.sums.clone()).cpu(), "world_size": rt.world_size,
            "rng": rt.gather_objects(_rng_state(rt.device, self.loader_generator)),
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
            _set_rng_state(state["rng"][rt.rank], rt.device, self.loader_generator)
        else:
            seed_rank(self.cfg.seed, rt.rank, self.step)  # no such rank before: a fresh stream, reproducibly


def _rng_state(device: torch.device, loader_generator: torch.Generator | None) -> dict[str, Any]:
    np_state = np.random.get_state()
    # weights_only loading accepts tensors and plain containers, not NumPy arrays
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "loader": loader_generator.get_state() if loader_generator is not None else None}


def _set_rng_state(rng: dict[str, Any], device: torch.device, loader_generator: torch.Generator | None) -> None:
    # Runtime.load mapped every tensor to the run's device; random states live on the CPU.
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(_as_tuples(rng["python"]))
    kind, keys, *rest = rng["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), *rest))
    if rng["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)
    if rng.get("loader") is not None and loader_generator is not None:
        loader_generator.set_state(rng["loader"].cpu())


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the tuples that torch.save stores and loads back as they were;
    # be lenient should a list come back.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class Outputs:
    """Everything `ddpkit train --out DIR` leaves; written by rank 0 only."""

    def __init__(self, cfg: TrainConfig, is_main: bool, resumed_step: tuple[int, int] | None = None):
        self.cfg, self.is_main, self.dir = cfg, is_main, cfg.out
        self._metrics = self._csv_file = self._csv = self._tb = None
        if not is_main:
            return
        os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        path = os.path.join(self.dir, "metrics.jsonl")
        kept = _records_until(path, *resumed_step) if resumed_step is not None else []
        self._metrics = open(path, "w", buffering=1)
        self._metrics.writelines(kept)  # a resumed run drops what came after its checkpoint
        # metrics.csv is rewritten from the kept records, so it always agrees with metrics.jsonl.
        self._csv_file = open(os.path.join(self.dir, "metrics.csv"), "w", newline="", buffering=1)
        self._csv = csv.DictWriter(self._csv_file, CSV_FIELDS, extrasaction="ignore")
        self._csv.writeheader()
        for line in kept:
            record = json.loads(line)
            if record.get("type") == "epoch":
                self._csv.writerow(record)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a previous attempt wrote after the checkpoint resumed from
            self._tb = SummaryWriter(os.path.join(self.dir, "tensorboard"),
                                     purge_step=resumed_step[0] + 1 if resumed_step else None)
        _write_yaml(os.path.join(self.dir, "config.yaml"), cfg.to_dict())

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self._metrics, self._csv_file, self._tb):
            if f is not None:
                f.close()

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics is None:
            return
        self._metrics.write(json.dumps(record) + "\n")
        if record.get("type") == "epoch":
            self._csv.writerow(record)
        if self._tb is not None:
            _tensorboard_scalars(self._tb, record)

    def progress(self, loader: Any, epoch: int) -> Any:
        """The loader, wrapped in a progress bar on rank 0 when stderr is a terminal."""
        if not (self.is_main and self.cfg.progress and sys.stderr.isatty()):
            return loader
        from tqdm.auto import tqdm

        return tqdm(loader, desc=f"epoch {epoch + 1}/{self.cfg.epochs}", unit="batch", leave=False)

    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.dir, "checkpoints", f"step-{step:08d}.pt")

    def prune_checkpoints(self) -> None:
        """Keep the newest --keep-checkpoints; older ones go only after the new one is complete."""
        if not self.is_main:
            return
        folder = os.path.join(self.dir, "checkpoints")
        for name in checkpoint_names(folder)[:-self.cfg.keep_checkpoints]:
            os.unlink(os.path.join(folder, name))

    def finish(self, results: dict[str, Any], model: Any, history: list[dict[str, Any]]) -> None:
        if not self.is_main:
            return
        save_file(os.path.join(self.dir, "model.pt"), unwrap(model).state_dict())
        with open(os.path.join(self.dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        plot_curves(history, os.path.join(self.dir, "curves.png"), title=f"{self.cfg.model} on {self.cfg.data}")

    def summary(self, r: dict[str, Any]) -> str:
        """The `done:` line (scripts parse it), then an aligned table of the run's results."""
        done = (f"done: test accuracy {r['test_accuracy']:.4f} on {r['test_samples']} samples | "
                f"{r['steps']} steps, {r['samples_per_second']:,.0f} samples/s on {r['world_size']} x {r['device']} | "
                f"{r['wall_seconds']:.1f} s | outputs in {self.dir}")
        rows = summary_rows(r)
        width = max(len(k) for k, _ in rows)
        return "\n".join([done, *(f"  {k:<{width}}  {v}" for k, v in rows)])


CSV_FIELDS = ("epoch", "step", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_samples",
              "epoch_seconds", "lr")


def _tensorboard_scalars(writer: Any, record: dict[str, Any]) -> None:
    """A metrics.jsonl record as TensorBoard scalars, against the optimizer step."""
    step = record.get("step", 0)
    if record.get("type") == "step":
        writer.add_scalar("train/loss", record["loss"], step)
        writer.add_scalar("train/lr", record["lr"], step)
        writer.add_scalar("train/samples_per_second", record["samples_per_second"], step)
    elif record.get("type") == "epoch":
        for split in ("train", "test"):
            writer.add_scalar(f"epoch/{split}_loss", record[f"{split}_loss"], step)
            writer.add_scalar(f"epoch/{split}_accuracy", record[f"{split}_accuracy"], step)
        if record.get("lr") is not None:
            writer.add_scalar("epoch/lr", record["lr"], step)


def summary_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The final summary table of a results dict, as (label, value) rows."""
    rows = [("test accuracy", f"{r['test_accuracy']:.4f} ({r['test_samples']} samples)"),
            ("test loss", f"{r['test_loss']:.4f}" if r.get("test_loss") is not None else "-"),
            ("train loss", f"{r['final_train_loss']:.4f}" if r.get("final_train_loss") is not None else "-"),
            ("epochs", f"{r.get('epochs_completed', r['epochs'])} of {r['epochs']}, {r['steps']} steps"),
            ("samples/s", f"{r['samples_per_second']:,.0f} on {r['world_size']} x {r['device']}")]
    if r.get("step_time_ms"):
        t = r["step_time_ms"]
        rows.append(("step time", f"p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f} ms"))
    if r.get("compile_seconds") is not None:
        rows.append(("compile", f"{r['compile_seconds']:.1f} s"))
    if r.get("peak_memory_mib"):
        kind = "GPU memory" if r.get("peak_memory_kind") == "cuda_max_allocated" else "RSS"
        rows.append((f"peak {kind}", " / ".join(f"{m:,.0f}" for m in r["peak_memory_mib"]) + " MiB per rank"))
    if r.get("mfu") is not None:
        rows.append(("MFU", f"{100 * r['mfu']:.1f}%"))
    if r.get("gpu_utilization_percent") is not None:
        rows.append(("GPU busy", f"{r['gpu_utilization_percent']:.0f}%"))
    rows.append(("wall time", f"{r['wall_seconds']:.1f} s"))
    return rows


def checkpoint_names(folder: str) -> list[str]:
    """Complete checkpoints in `folder`, oldest first. Writes go to '.tmp-*' files renamed
    only when complete, so a half-written file never has a checkpoint's name."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.startswith("step-") and n.endswith(".pt"))


def _records_until(path: str, step: int, epochs_done: int) -> list[str]:
    """Lines of an existing metrics.jsonl up to a checkpoint: step at most `step`, and epoch
    records only of epochs it completed. A torn last line (a full disk) is dropped."""
    if not os.path.exists(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step", 0) <= step and (record.get("type") != "epoch" or record["epoch"] <= epochs_done):
                kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _write_yaml(path: str, mapping: dict[str, Any]) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(mapping, f, sort_keys=False)
