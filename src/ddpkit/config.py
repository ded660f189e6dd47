"""Typed configuration for `ddpkit train`. Each field is a command-line flag (`batch_size` is
`--batch-size`) and a key of `--config FILE.yaml`; each check names the flag at fault."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from . import models
from .data import DATASETS, Augment, shape_of
from .errors import UsageError
from .models import MODELS
from .precision import PRECISIONS
from .runtime import DEVICES
from .strategy import COMM_HOOKS, STRATEGIES, DDPOptions

OPTIMIZERS = ("sgd", "adamw")
LOADERS = ("auto", "device", "dataloader")
LR_SCALINGS = ("none", "linear", "sqrt")


def _choice(flag: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise UsageError(f"{flag}: unknown value {value!r}; choose from {', '.join(choices)}")


def _positive(flag: str, value: float | int) -> None:
    if not value > 0 or not math.isfinite(value):  # `not >` also catches NaN
        raise UsageError(f"{flag} must be positive, got {value}")


@dataclass
class TrainConfig:
    """Train a built-in model on a built-in dataset over all local devices."""

    data: str = "digits"  # dataset: digits (offline default), synthetic, toy, mnist, fashion-mnist or cifar10
    data_dir: Optional[str] = None  # dataset files: DIR/<dataset>/ (default $DDPKIT_DATA, else ~/.cache/ddpkit/data)
    model: str = "cnn"  # cnn, simple-cnn, lenet, mlp, resnet18, fast-cifar (a recipe: see README), or your own package.module:function, called as function(in_shape, num_classes) -> nn.Module
    nproc: str = "auto"  # processes on this machine: N, or auto (one per GPU; on CPU one per 4 cores)
    device: str = "auto"  # auto, cpu or cuda
    strategy: str = "ddp"  # ddp, dp (nn.DataParallel, one process) or single
    epochs: int = 10  # passes over the training set
    batch_size: int = 64  # GLOBAL batch: samples per optimizer step over all processes together
    micro_batch_size: Optional[int] = None  # most samples per forward on one process; more accumulate
    lr: float = 0.05  # learning rate at --reference-batch-size (peak; cosine decay to zero)
    lr_scaling: str = "none"  # none, linear or sqrt: scale --lr by (batch-size / reference-batch-size)
    reference_batch_size: int = 64  # the global batch --lr was tuned for (used by --lr-scaling)
    warmup_epochs: float = 0.0  # linear warmup: from the reference LR (or 0) up to the peak
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (CUDA only)
    optimizer: str = "sgd"  # sgd (with --momentum) or adamw
    momentum: float = 0.9  # SGD momentum, Nesterov when > 0; 0 is plain SGD (the d2l and DDP tutorials)
    weight_decay: float = 5e-4  # L2 penalty
    precision: str = "fp32"  # fp32, bf16 or fp16 (fp16 uses a GradScaler)
    seed: int = 0  # seeds model init, shuffling and synthetic data
    out: Optional[str] = None  # output directory (default: runs/<date>-<time>)
    resume: Optional[str] = None  # auto (newest checkpoint in --out) or a checkpoint file
    checkpoint_every: int = 0  # also checkpoint every N optimizer steps (0: at epoch ends only)
    keep_checkpoints: int = 2  # newest checkpoints kept in --out/checkpoints
    max_steps: Optional[int] = None  # stop (with a checkpoint) after this many optimizer steps
    max_restarts: int = 0  # when a worker dies, restart all of them (up to N times) from the newest checkpoint
    nnodes: str = "1"  # machines: N, or MIN:MAX; each runs the same command with --master-addr
    node_rank: Optional[int] = None  # 0 on the machine that hosts the rendezvous
    master_addr: Optional[str] = None  # address of that machine (needed with --nnodes > 1)
    master_port: int = 29500  # rendezvous port on that machine
    eval_batch_size: int = 512  # global batch for evaluation
    num_workers: Optional[int] = None  # DataLoader workers per process (default: 0 on CPU, up to 4 on CUDA)
    log_every: int = 10  # write a step record to metrics.jsonl every N optimizer steps
    timeout: float = 600.0  # seconds a collective may wait for the slowest rank
    on_nonfinite: str = "stop"  # a NaN/inf loss: stop (naming step and rank), or skip that step on all ranks
    synthetic_shape: str = "3,32,32"  # synthetic data: C,H,W of one sample
    synthetic_size: int = 4096  # synthetic data: training samples (test gets a fifth as many)
    num_classes: int = 10  # synthetic data: number of classes
    progress: bool = True  # progress bar on rank 0 (only when stderr is a terminal)
    tensorboard: bool = False  # also write TensorBoard event files to --out/tensorboard
    loader: str = "auto"  # auto (device-resident for in-memory sets), device, or dataloader
    augment: str = "none"  # training augmentation: none, crop, flip or crop-flip (images only)
    crop_padding: int = 4  # --augment crop: zero-pad by this many pixels, then crop back
    label_smoothing: float = 0.0  # cross-entropy label smoothing (0 to 1)
    channels_last: bool = False  # NHWC model and batches (faster convolutions with bf16/fp16 on GPUs)
    compile: bool = False  # torch.compile the model (compile time is reported apart from step times)
    bucket_cap_mb: Optional[float] = None  # DDP gradient bucket size in MiB (torch default 25)
    gradient_as_bucket_view: bool = False  # DDP: gradients live in the all-reduce buckets (saves a copy)
    static_graph: bool = False  # DDP: the same parameters are used every step (lets DDP skip checks)
    comm_hook: str = "none"  # DDP gradient compression for the all-reduce: none, fp16 or bf16

    def __post_init__(self) -> None:
        _choice("--data", self.data, DATASETS)
        if not models.is_custom(self.model):  # package.module:function is checked by import below
            _choice("--model", self.model, [*MODELS, "package.module:function"])
        _choice("--device", self.device, DEVICES)
        _choice("--strategy", self.strategy, STRATEGIES)
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--lr-scaling", self.lr_scaling, LR_SCALINGS)
        _choice("--on-nonfinite", self.on_nonfinite, ("stop", "skip"))
        _choice("--loader", self.loader, LOADERS)
        _choice("--augment", self.augment, Augment.NAMES)
        _choice("--comm-hook", self.comm_hook, COMM_HOOKS)
        if self.bucket_cap_mb is not None:
            _positive("--bucket-cap-mb", self.bucket_cap_mb)
        if not 0 <= self.label_smoothing < 1:
            raise UsageError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.crop_padding < 0:
            raise UsageError(f"--crop-padding must be >= 0, got {self.crop_padding}")
        if self.augment != "none" and len(shape_of(self.data, self.shape(), self.num_classes)[0]) != 3:
            raise UsageError(f"--augment {self.augment} needs image data (C,H,W); --data {self.data} is not")
        if not (self.nproc == "auto" or str(self.nproc).isdigit()) or str(self.nproc) == "0":
            raise UsageError(f"--nproc must be a positive integer or 'auto', got {self.nproc!r}")
        for flag in ("epochs", "batch_size", "lr", "eval_batch_size", "log_every", "timeout",
                     "synthetic_size", "num_classes", "reference_batch_size", "keep_checkpoints"):
            _positive("--" + flag.replace("_", "-"), getattr(self, flag))
        for flag in ("micro_batch_size", "max_steps"):
            if getattr(self, flag) is not None:
                _positive("--" + flag.replace("_", "-"), getattr(self, flag))
        for flag in ("checkpoint_every", "warmup_epochs", "max_restarts"):
            if not getattr(self, flag) >= 0:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(self, flag)}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.num_workers is not None and self.num_workers < 0:
            raise UsageError(f"--num-workers must be >= 0, got {self.num_workers}")
        try:
            models.check(self.model, *shape_of(self.data, self.shape(), self.num_classes))
        except ValueError as err:
            raise UsageError(f"--model {self.model}: {err}") from None
        if self.resume == "auto" and self.out is None:
            raise UsageError("--resume auto needs --out DIR, the run directory to look for checkpoints in")

    def shape(self) -> tuple[int, ...]:
        try:
            dims = tuple(int(d) for d in self.synthetic_shape.split(","))
        except ValueError:
            dims = ()
        if not dims or min(dims) <= 0:
            raise UsageError(f"--synthetic-shape must be positive integers like 3,32,32, got {self.synthetic_shape!r}")
        return dims

    def peak_lr(self) -> float:
        """--lr scaled for the global batch by --lr-scaling (the tutorials' "N x batch, N x LR")."""
        ratio = self.batch_size / self.reference_batch_size
        return self.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]

    def resident(self) -> bool | None:
        """--loader as Runtime.loader's `resident` argument."""
        return {"auto": None, "device": True, "dataloader": False}[self.loader]

    def ddp_options(self) -> DDPOptions:
        return DDPOptions(self.bucket_cap_mb, self.gradient_as_bucket_view, self.static_graph, self.comm_hook)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))

# `--model NAME` recipes: defaults a model is meant to be trained with, applied under the
# YAML file and the command line (both override them). "cuda" entries apply on GPUs only.
RECIPES: dict[str, dict[str, Any]] = {
    # In the spirit of the CIFAR-10 speed runs: a large batch with a short warmup and cosine
    # decay, label smoothing, crop (2 px) + flip augmentation done on the device, and on GPUs
    # bf16 with channels_last.
    "fast-cifar": {"batch_size": 1024, "reference_batch_size": 1024, "lr": 0.4, "warmup_epochs": 1.0,
                   "epochs": 10, "label_smoothing": 0.2, "augment": "crop-flip", "crop_padding": 2,
                   "weight_decay": 5e-4, "eval_batch_size": 2048,
                   "cuda": {"precision": "bf16", "channels_last": True}},
}


def recipe(model: str, device_type: str) -> dict[str, Any]:
    """The defaults `--model` brings on `device_type` ('cpu' or 'cuda')."""
    values = dict(RECIPES.get(model, {}))
    gpu = values.pop("cuda", {})
    return {**values, **(gpu if device_type == "cuda" else {})}
