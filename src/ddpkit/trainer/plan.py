"""Resolve once: a `TrainConfig` becomes one immutable `RunPlan` in the launching process,
before any worker starts.

Every setting of a `ddpkit train` run is checked from here (by the table below, or by building
the core object that owns it) and every value derived from the settings is computed here: a
bad flag, file or combination is one line and exit 2 before anything runs, and the workers,
the loop and the outputs read the plan instead of deriving anything again. (Only the YAML
file's keys and types, and the `--device` that picks a recipe, are read earlier, when the
command line is parsed.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from .. import data, models
from .. import strategy as strategies
from ..core import checks
from ..core import device as devices
from ..core.files import check_writable
from ..core.precision import PRECISIONS
from ..data import Augment
from ..errors import UsageError
from ..launcher import Nodes, Topology
from ..launcher import topology as topologies
from ..observe import tracking
from ..optim import OPTIMIZERS
from ..strategy import STRATEGIES, DDPOptions, FSDPOptions, activations
from . import resume, rundir
from .config import FIELDS, TrainConfig, model_options

LOADERS = {"auto": None, "device": True, "dataloader": False}  # --loader -> Runtime.loader(resident=...)
LR_SCALINGS = ("none", "linear", "sqrt")
WORKERS_PER_CORE = 4  # DataLoader workers per process beyond which --num-workers is refused (torch warns at 1)
MAX_TIMEOUT = 1e9  # seconds (31 years): far below where a timedelta or torch's milliseconds overflow

# Each setting's own rule (the rules between settings are in `resolve`). POSITIVE settings that
# may be left unset (micro_batch_size, max_steps) are checked only when set. Settings that a
# core object owns are checked by building it in `resolve`, once: --augment (Augment),
# --comm-hook and --bucket-cap-mb (DDPOptions), --model (models.check), and --device, --nproc,
# --nnodes and --max-restarts (launcher.topology).
CHOICES = {
    "data": data.DATASETS,
    "strategy": STRATEGIES,
    "precision": PRECISIONS,
    "optimizer": OPTIMIZERS,
    "lr_scaling": LR_SCALINGS,
    "on_nonfinite": ("stop", "skip"),
    "loader": tuple(LOADERS),
    "pp_schedule": strategies.SCHEDULES,
    "gpt_style": models.GPT_STYLES,
    "activation_checkpointing_mode": activations.MODES,
}
POSITIVE = (
    "epochs",
    "batch_size",
    "lr",
    "eval_batch_size",
    "log_every",
    "timeout",
    "synthetic_size",
    "num_classes",
    "reference_batch_size",
    "keep_checkpoints",
    "micro_batch_size",
    "max_steps",
    "max_grad_norm",
    "early_stop_patience",
    "ema",
    "seq_len",
    "gpt_width",
    "gpt_depth",
    "gpt_heads",
    "gpt_kv_heads",
    "gpt_hidden",
)
AT_LEAST_ZERO = (
    "checkpoint_every",
    "progress_every",
    "warmup_epochs",
    "crop_padding",
    "weight_decay",
    "num_workers",
    "early_stop_min_delta",
)
FRACTIONS = ("momentum", "label_smoothing", "gpt_dropout")  # in [0, 1)


@dataclass(frozen=True)
class RunPlan:
    """A `ddpkit train` run, resolved.

    cfg holds the settings as given (with `--out` filled in): the global batch
    (`cfg.batch_size`), micro-batch, strategy, precision and every plain knob of the loop.
    The rest is derived here, once: where the processes run (`topology`: device type,
    process count, world size, nodes), the dataset's input shape and classes, the training
    augmentation, the peak learning rate and where warmup starts, the data path (`resident`),
    the DDP and FSDP options, and the checkpoint to resume from.
    """

    cfg: TrainConfig
    topology: Topology
    in_shape: tuple[int, ...]
    num_classes: int
    augment: Augment | None  # for image data; None: no augmentation
    peak_lr: float
    warmup_start: float  # the LR factor warmup starts from (Goyal et al.: the reference LR)
    resident: bool | None  # Runtime.loader's `resident`: None lets the loader choose
    ddp: DDPOptions
    resume: str | None
    fsdp: FSDPOptions = FSDPOptions()

    @property
    def out(self) -> str:
        return self.cfg.out  # type: ignore[return-value]  # filled in by resolve


def make_plan(cfg: TrainConfig) -> RunPlan:
    """The plan of `cfg`, and the run made ready: dataset files downloaded and read once (so
    workers only read them), `--out` created, proven writable and locked for this run (see
    `rundir`). Rejected input leaves nothing behind: every other check runs first (`resolve`)."""
    locks = rundir.takes_lock(cfg.nnodes, cfg.node_rank)
    if cfg.out is not None:  # another run there is named before its checkpoints are judged as ours
        rundir.check(cfg.out, locks)
    plan = resolve(cfg)
    # Under torchrun every worker gets here: downloads are temp file + rename, so concurrent
    # ones are safe.
    data.prepare(cfg.data, cfg.data_dir, cfg.text_path, cfg.seq_len)
    _warn_batch_above_set(cfg)
    check_writable(f"--out {plan.out}", os.path.join(plan.out, "checkpoints"))
    if locks:
        rundir.claim(plan.out)  # held until this process exits, before any worker starts
    return plan


def resolve(cfg: TrainConfig) -> RunPlan:
    """Check every setting of `cfg` and derive what the run needs, writing nothing; a
    UsageError (exit 2) names the first thing wrong."""
    check_settings(cfg)
    cfg = dataclasses.replace(cfg, out=cfg.out or time.strftime("runs/%Y%m%d-%H%M%S"))
    nodes = Nodes(cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port)
    mesh = None if cfg.mesh is None else strategies.MeshSpec.parse(cfg.mesh)
    cfg = dataclasses.replace(cfg, strategy=strategies.for_mesh(cfg.strategy, mesh))  # --mesh tp=2: tp
    one_process = f"--strategy {cfg.strategy}" if strategies.by_name(cfg.strategy).one_process else None
    topology = topologies.resolve(cfg.device, cfg.nproc, nodes, cfg.max_restarts, one_process)
    augment = Augment.parse(cfg.augment, cfg.crop_padding)
    in_shape, num_classes = _data_shape(cfg, augment)
    if cfg.data == "synthetic":  # every local process builds the whole set
        checks.memory(
            _synthetic_what(cfg), data.synthetic_bytes(in_shape, cfg.synthetic_size, num_classes), topology.nproc
        )
    layout = _layout(cfg, mesh, topology, in_shape, num_classes)
    cfg = _pipeline_micro_batches(cfg, layout)
    if layout.data_size == topology.world_size:  # every node's processes
        data.check_global_batch(cfg.batch_size, topology.world_size)
    else:  # tensor-parallel ranks share their samples
        data.check_global_batch(cfg.batch_size, layout.data_size, "data rank", f"data ranks of --mesh {layout}")
    ddp = DDPOptions(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(DDPOptions)})  # the DDP flags
    _check_device_features(cfg, topology.device_type, ddp)
    fsdp = _fsdp_options(cfg)
    if cfg.model in models.LANGUAGE_MODELS:  # before it is built below
        per_weight = strategies.by_name(cfg.strategy).bytes_per_weight(topology.world_size)
        shape = {k: v for k, v in model_options(cfg).items() if k in ("style", "heads", "kv_heads", "hidden")}
        models.check_gpt_memory(
            cfg.seq_len, num_classes, cfg.gpt_width, cfg.gpt_depth, per_weight, topology.nproc, **shape
        )
    asked = strategies.by_name(cfg.strategy)
    if cfg.sync_batchnorm and not asked.sync_batchnorm:
        raise UsageError(asked.refuses_sync_batchnorm or f"--strategy {cfg.strategy} does not support --sync-batchnorm")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise UsageError(f"--out {cfg.out}: exists and is not a directory")
    checkpoint = resume.starting_point(cfg, in_shape, num_classes)  # a bad --resume fails here
    if checkpoint is not None and not os.path.isdir(checkpoint) and layout.size("pp") > 1 and layout.size("tp") > 1:
        raise UsageError(
            f"--resume: {checkpoint} is a one-process (or ddp) checkpoint, whose optimizer state does not load under "
            f"--mesh {layout} yet (pp with tp); resume it on another layout first: its checkpoints load here"
        )
    peak_lr = cfg.lr * _lr_scale(cfg)
    scale = peak_lr / cfg.lr
    warmup_start = 1.0 / scale if scale > 1 else 0.0
    return RunPlan(
        cfg, topology, in_shape, num_classes, augment, peak_lr, warmup_start, LOADERS[cfg.loader], ddp, checkpoint, fsdp
    )


def _layout(
    cfg: TrainConfig,
    mesh: strategies.MeshSpec | None,
    topology: Topology,
    in_shape: tuple[int, ...],
    num_classes: int,
) -> strategies.MeshSpec:
    """The mesh the run's processes form (checked against their number), and under tp the
    model's split checked against it: what the workers' Runtime will build."""
    low, high = topology.nodes.range()
    if mesh is not None and low != high and topology.launcher == "ddpkit":
        raise UsageError(f"--mesh {mesh}: a mesh needs a fixed number of machines, not --nnodes {cfg.nnodes}")
    spec = strategies.mesh_for(strategies.by_name(cfg.strategy), mesh, topology.world_size, topology.nproc)
    tp = spec.size("tp")
    kv_heads = cfg.gpt_kv_heads or cfg.gpt_heads
    if tp > 1 and cfg.model == "gpt" and (cfg.gpt_heads % tp or kv_heads % tp or num_classes % tp):
        kv = f", --gpt-kv-heads {kv_heads}" if kv_heads != cfg.gpt_heads else ""
        raise UsageError(
            f"--mesh {spec}: gpt splits whole heads and its vocabulary over the tp ranks: --gpt-heads "
            f"{cfg.gpt_heads}{kv} and the {num_classes} tokens must be multiples of {tp}"
        )
    if tp > 1 or spec.size("pp") > 1:
        model = models.build_shapes(cfg.model, in_shape, num_classes, **model_options(cfg))
        strategies.check_model(spec, model, cfg.model, cfg.precision, cfg.compile)
    return spec


def _pipeline_micro_batches(cfg: TrainConfig, layout: strategies.MeshSpec) -> TrainConfig:
    """Under pp, the micro-batches are the pipeline's: without --micro-batch-size, each data
    rank's share of a step is cut into as many as there are stages, or a few more where equal
    pieces cannot make that many (the results do not depend on it); with it, 1f1b needs at least
    as many micro-batches as stages."""
    pp = layout.size("pp")
    if pp == 1:
        return cfg
    share = -(-cfg.batch_size // layout.data_size)
    if cfg.micro_batch_size is None:
        if share < pp and cfg.pp_schedule == "1f1b":
            raise UsageError(
                f"--mesh {layout}: a step's {share} sample(s) per data rank cannot fill {pp} pipeline stages; "
                f"raise --batch-size to at least {pp * layout.data_size}, or use --pp-schedule gpipe"
            )
        return dataclasses.replace(cfg, micro_batch_size=strategies.micro_batch_size(share, pp))
    chunks = -(-share // min(cfg.micro_batch_size, share))
    if chunks < pp and cfg.pp_schedule == "1f1b":
        raise UsageError(
            f"--pp-schedule 1f1b: --micro-batch-size {cfg.micro_batch_size} gives {chunks} micro-batch(es) per step "
            f"for {pp} pipeline stages; give at most {-(-share // pp)}, or use --pp-schedule gpipe"
        )
    return cfg


def check_settings(cfg: TrainConfig) -> None:
    """Each setting on its own: names known, numbers in range."""
    for name, choices in CHOICES.items():
        checks.choice(checks.flag(name), getattr(cfg, name), choices)
    for name in POSITIVE:
        if getattr(cfg, name) is not None:
            checks.positive(checks.flag(name), getattr(cfg, name))
    for name in AT_LEAST_ZERO:
        if getattr(cfg, name) is not None:
            checks.at_least(checks.flag(name), getattr(cfg, name), 0)
    if cfg.num_classes < 2:  # one class: every prediction right by construction, nothing to learn
        raise UsageError(
            f"--num-classes must be at least 2 (a classifier of one class learns nothing), got {cfg.num_classes}"
        )
    checks.thread_count_variable()
    for name in FRACTIONS:
        checks.in_range(checks.flag(name), getattr(cfg, name), 0, 1)
    workers = WORKERS_PER_CORE * devices.cpu_count()
    if cfg.num_workers is not None and cfg.num_workers > workers:  # each one a process: a typo would fork-bomb
        raise UsageError(
            f"--num-workers must be at most {workers} ({WORKERS_PER_CORE} per usable core), got {cfg.num_workers}"
        )
    if cfg.timeout > MAX_TIMEOUT:  # torch turns it into a timedelta, then into int64 milliseconds
        raise UsageError(f"--timeout must be at most {MAX_TIMEOUT:g} seconds, got {cfg.timeout:g}")
    if cfg.resume == "auto" and cfg.out is None:
        raise UsageError("--resume auto needs --out DIR, the run directory to look for checkpoints in")
    for name in FIELDS:  # a YAML file's integers are not bounded by the command line's parser
        value = getattr(cfg, name)
        if isinstance(value, int) and not isinstance(value, bool):
            checks.integer(checks.flag(name), value, *checks.INT64)
    checks.integer("--seed", cfg.seed, 0, 2**32 - 1)  # NumPy's seeds are 32-bit; torch's take these too
    if cfg.data_dir:  # checked whatever --data is: a file there is a mistake either way
        checks.directory("--data-dir", os.path.expanduser(cfg.data_dir))
    if cfg.text_path is not None and cfg.data not in data.TEXT_DATASETS:
        raise UsageError(f"--text-path is the text of --data text; this run has --data {cfg.data}")
    if cfg.text_path is not None and not os.path.exists(os.path.expanduser(cfg.text_path)):
        raise UsageError(f"--text-path {cfg.text_path}: no such file or directory")
    if cfg.ema is not None and cfg.ema >= 1:  # 1 would never move: the initial weights
        raise UsageError(f"--ema must be below 1 (the weight kept at each step, as 0.999), got {cfg.ema}")
    if not cfg.activation_checkpointing and _is_set(cfg, "activation_checkpointing_mode"):
        raise UsageError("--activation-checkpointing-mode applies with --activation-checkpointing true only")
    if cfg.early_stop_patience is None and _is_set(cfg, "early_stop_min_delta"):
        raise UsageError("--early-stop-min-delta applies with --early-stop-patience only")
    language = cfg.model in models.LANGUAGE_MODELS  # (another model's gpt flags: data.check_applies)
    shape = models.gpt_shape_error(cfg.gpt_width, cfg.gpt_heads, cfg.gpt_kv_heads, cfg.gpt_style, cfg.gpt_hidden)
    if shape and language:
        raise UsageError(shape)


def build_model(cfg: TrainConfig, in_shape: tuple[int, ...], num_classes: int) -> Any:
    """The run's model, as every rank builds it: `--model` with its options (gpt's flags)."""
    return models.build(cfg.model, in_shape, num_classes, **model_options(cfg))


def _data_shape(cfg: TrainConfig, augment: Augment | None) -> tuple[tuple[int, ...], int]:
    """The dataset's (input shape, classes), checked against the model and the augmentation."""
    in_shape, num_classes = data.shape_of(
        cfg.data, checks.shape("--synthetic-shape", cfg.synthetic_shape), cfg.num_classes, cfg.seq_len
    )
    language = cfg.model in models.LANGUAGE_MODELS
    data.check_pairing(cfg.data, cfg.model, language)
    if augment is not None and len(in_shape) != 3:
        raise UsageError(f"--augment {cfg.augment} needs image data (C,H,W); --data {cfg.data} is not")
    if augment is not None and augment.crop_padding > min(in_shape[1:]):  # crops of padding, and huge pads
        raise UsageError(
            f"--crop-padding {cfg.crop_padding} is more than the images' side ({in_shape[1]}x{in_shape[2]})"
        )
    models.check(cfg.model, in_shape, num_classes)
    data.check_applies(cfg.data, cfg.model, language, [name for name in FIELDS if _is_set(cfg, name)])
    if cfg.activation_checkpointing:
        import torch  # (the model on meta: shapes, no memory; torch is loaded by the check above)

        with torch.device("meta"):
            model = build_model(cfg, in_shape, num_classes)
        if not activations.chosen(model, True):
            raise UsageError(
                f"--activation-checkpointing: --model {cfg.model} has no block to checkpoint "
                "(no child module that holds parameters)"
            )
    return in_shape, num_classes


def _synthetic_what(cfg: TrainConfig) -> str:
    return (
        f"--data synthetic with --synthetic-size {cfg.synthetic_size}, --synthetic-shape {cfg.synthetic_shape} "
        f"and --num-classes {cfg.num_classes}"
    )


def _warn_batch_above_set(cfg: TrainConfig) -> None:
    """A global batch larger than the training set makes every step the whole set. That may be
    meant (a recipe's batch on a small smoke-test set), or a typo that --lr-scaling would
    multiply into the LR: said once, not refused. Files are read by now."""
    size = data.train_size(cfg.data, cfg.data_dir, cfg.synthetic_size, cfg.text_path, cfg.seq_len)
    if cfg.batch_size > size:
        print(
            f"ddpkit train: warning: --batch-size {cfg.batch_size} is larger than the {size} training samples of "
            f"--data {cfg.data}: every step is the whole set",
            file=sys.stderr,
        )


def _fsdp_options(cfg: TrainConfig) -> FSDPOptions:
    """The --fsdp-* flags, which only --strategy fsdp uses (on one process it runs as single)."""
    fsdp = FSDPOptions(
        reshard_after_forward=cfg.fsdp_reshard_after_forward,
        reduce_dtype=cfg.fsdp_reduce_dtype,
        cpu_offload=cfg.fsdp_cpu_offload,
    )
    changed = [f for f in ("fsdp_reshard_after_forward", "fsdp_reduce_dtype", "fsdp_cpu_offload") if _is_set(cfg, f)]
    if changed and not strategies.by_name(cfg.strategy).takes_fsdp_options:
        raise UsageError(
            f"{checks.flag(changed[0])} applies to --strategy fsdp only (this run has --strategy {cfg.strategy})"
        )
    return fsdp


def _is_set(cfg: TrainConfig, name: str) -> bool:
    return getattr(cfg, name) != getattr(TrainConfig, name)


def _check_device_features(cfg: TrainConfig, device_type: str, ddp: DDPOptions) -> None:
    if cfg.sync_batchnorm and device_type != "cuda":
        raise UsageError("--sync-batchnorm needs --device cuda: torch's SyncBatchNorm runs on GPUs only")
    if cfg.sync_batchnorm and cfg.micro_batch_size:
        # SyncBatchNorm all-reduces in every forward; ranks may run different numbers of them.
        raise UsageError("--sync-batchnorm cannot be combined with --micro-batch-size")
    ddp.check_device(device_type)
    ddp.check_compile(cfg.compile)
    for name in tracking.TRACKERS:  # --tensorboard, --mlflow, --wandb: installed?
        if getattr(cfg, name):
            tracking.check_installed(name, f"--{name}")
    if cfg.precision == "fp16" and device_type == "cpu":
        # Measured by `ddpkit bench precision`: tens of times slower than fp32 on CPUs.
        print(
            "ddpkit train: warning: --precision fp16 on CPU is usually much slower than fp32 (few CPUs have fast "
            "fp16 kernels); bf16 is faster on CPUs with native bf16 (AVX-512 BF16, AMX)",
            file=sys.stderr,
        )


def _lr_scale(cfg: TrainConfig) -> float:
    """--lr-scaling: the factor for the global batch (the tutorials' "N x batch, N x LR")."""
    ratio = cfg.batch_size / cfg.reference_batch_size
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]
