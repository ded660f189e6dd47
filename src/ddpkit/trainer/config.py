"""The settings of `ddpkit train`: the typed `TrainConfig`, the recipes a `--model` brings,
and the layering of defaults, recipe, YAML file and command line.

Each field is a command-line flag (`batch_size` is `--batch-size`) and a key of
`--config FILE.yaml`; the comment after it is its `--help` text. Only the YAML file's keys and
value types are checked here (and `--device`, where a recipe has a GPU part): the plan
(`trainer.plan.resolve`) checks and derives every setting, once.
"""

# No `from __future__ import annotations` here: simple-parsing reads every field's type with
# typing.get_type_hints over the whole class, which for string annotations compiles every one
# of them again for each field (some 4 000 compilations, 60 ms of each `ddpkit train`).
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..core import checks
from ..core import device as devices
from ..errors import UsageError


@dataclass(frozen=True)
class TrainConfig:
    """Train a built-in model on a built-in dataset over all local devices."""

    data: str = "digits"  # dataset: digits (offline default), synthetic, toy, mnist, fashion-mnist, cifar10, or text (for --model gpt)
    data_dir: str | None = None  # dataset files: DIR/<dataset>/ (default $DDPKIT_DATA, else ~/.cache/ddpkit/data)
    model: str = "cnn"  # cnn, simple-cnn, lenet, mlp, resnet18, fast-cifar, gpt (both recipes: see docs/flags.md), or your own package.module:function, called as function(in_shape, num_classes) -> nn.Module
    nproc: str = "auto"  # processes on this machine: N, or auto (one per GPU; on CPU one per 4 cores)
    device: str = "auto"  # auto, cpu or cuda
    strategy: str = "ddp"  # ddp, fsdp (FSDP2: parameters sharded), hsdp (sharded per replica), tp (tensor parallel, fsdp over dp), pp (pipeline stages), dp (nn.DataParallel, one process) or single
    mesh: str | None = None  # process layout, e.g. dp=2,tp=2 or pp=2; tp/replicate/pp pick the strategy
    pp_schedule: str = "1f1b"  # --mesh pp: the pipeline schedule, 1f1b or gpipe
    epochs: int = 10  # passes over the training set
    batch_size: int = 64  # GLOBAL batch: samples per optimizer step over all processes together
    micro_batch_size: int | None = None  # most samples per forward on one process; more accumulate
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
    out: str | None = None  # output directory (default: runs/<date>-<time>)
    resume: str | None = None  # auto (newest checkpoint in --out) or a checkpoint file
    checkpoint_every: int = 0  # also checkpoint every N optimizer steps (0: at epoch ends only)
    keep_checkpoints: int = 2  # newest checkpoints kept in --out/checkpoints
    max_steps: int | None = None  # stop (with a checkpoint) after this many optimizer steps
    max_restarts: int = 0  # when a worker dies, restart all of them (up to N times) from the newest checkpoint
    nnodes: str = "1"  # machines: N, or MIN:MAX; each runs the same command with --master-addr
    node_rank: int | None = None  # 0 on the machine that hosts the rendezvous
    master_addr: str | None = None  # address of that machine (needed with --nnodes > 1)
    master_port: int = 29500  # rendezvous port on that machine
    eval_batch_size: int = 512  # global batch for evaluation
    num_workers: int | None = None  # DataLoader workers per process (default: 0 on CPU, up to 4 on CUDA)
    log_every: int = 10  # write a step record to metrics.jsonl every N optimizer steps
    timeout: float = 600.0  # seconds a collective may wait for the slowest rank
    on_nonfinite: str = "stop"  # a NaN/inf loss: stop (naming step and rank), or skip that step on all ranks
    synthetic_shape: str = "3,32,32"  # synthetic data: C,H,W of one sample
    synthetic_size: int = 4096  # synthetic data: training samples (test gets a fifth as many)
    num_classes: int = 10  # synthetic data: number of classes
    # --data text: a text file, or a directory of them (default: the Python standard library's sources)
    text_path: str | None = None
    seq_len: int = 128  # --data text: bytes per sequence, the gpt model's context length
    gpt_width: int = 128  # --model gpt: embedding width
    gpt_depth: int = 4  # --model gpt: transformer blocks (each one fsdp shard unit)
    gpt_heads: int = 4  # --model gpt: attention heads (--gpt-width must be a multiple)
    # --model gpt: gpt2 (LayerNorm, GELU MLP, learned positions) or llama (RMSNorm, SwiGLU, rotary
    # positions, no biases)
    gpt_style: str = "gpt2"
    gpt_kv_heads: int | None = None  # --model gpt: key/value heads (fewer than --gpt-heads: grouped-query attention)
    gpt_hidden: int | None = None  # --model gpt: the MLP's hidden width (default 4x the width; llama: about 8/3x)
    # --model gpt: dropout on each block's attention and MLP outputs (GPT-2's), whose masks do not
    # depend on the number of processes
    gpt_dropout: float = 0.0
    progress: bool = True  # progress bar on rank 0 (only when stderr is a terminal)
    # with --progress and no terminal (a log file, a batch job): a progress line at most every N
    # seconds, at a log step (0: none)
    progress_every: float = 30.0
    tensorboard: bool = False  # also write TensorBoard event files to --out/tensorboard
    mlflow: bool = False  # also log to MLflow: a local store in --out/mlflow unless MLFLOW_TRACKING_URI is set
    wandb: bool = False  # also log to Weights & Biases: offline in --out/wandb unless WANDB_MODE is set
    loader: str = "auto"  # auto (device-resident for in-memory sets), device, or dataloader
    augment: str = "none"  # training augmentation: none, crop, flip or crop-flip (images only)
    crop_padding: int = 4  # --augment crop: zero-pad by this many pixels, then crop back
    label_smoothing: float = 0.0  # cross-entropy label smoothing (0 to 1)
    early_stop_patience: int | None = None  # stop once the test loss has not improved for N epochs
    early_stop_min_delta: float = 0.0  # --early-stop-patience: a fall of more than this is an improvement
    ema: float | None = None  # average the weights with this decay (as 0.999), evaluated and saved beside them
    max_grad_norm: float | None = None  # clip gradients to this total 2-norm before each step (fsdp: over all shards)
    channels_last: bool = False  # NHWC model and batches (faster convolutions with bf16/fp16 on GPUs)
    compile: bool = False  # torch.compile the model (compile time is reported apart from step times)
    activation_checkpointing: bool = (
        False  # each block keeps only its inputs for backward, recomputed there: less memory, same result
    )
    # with --activation-checkpointing: full (a block keeps its inputs only) or selective (also its
    # attention's and every other matrix product's outputs: less recomputation, more memory)
    activation_checkpointing_mode: str = "full"
    bucket_cap_mb: float | None = None  # DDP gradient bucket size in MiB (torch default 25)
    gradient_as_bucket_view: bool = False  # DDP: gradients live in the all-reduce buckets (saves a copy)
    static_graph: bool = False  # DDP: the same parameters are used every step (lets DDP skip checks)
    comm_hook: str = "none"  # DDP gradient compression for the all-reduce: none, fp16 or bf16
    find_unused_parameters: bool = False  # DDP: let a forward leave parameters unused (DDP then looks for them)
    broadcast_buffers: bool = True  # DDP: rank 0's buffers (BatchNorm statistics) to all ranks before each forward
    fsdp_reshard_after_forward: bool = True  # fsdp: free gathered parameters after each unit's forward (less memory)
    fsdp_reduce_dtype: str = "fp32"  # fsdp: reduce-scatter gradients in fp32, bf16 or fp16
    fsdp_cpu_offload: bool = False  # fsdp: shards, gradients and optimizer state in host memory (CUDA not run)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))

# `--model NAME` recipes: defaults a model is meant to be trained with, applied under the
# YAML file and the command line (both override them). "cuda" entries apply on GPUs only.
RECIPES: dict[str, dict[str, Any]] = {
    # In the spirit of the CIFAR-10 speed runs: a large batch with a short warmup and cosine
    # decay, label smoothing, crop (2 px) + flip augmentation done on the device, and on GPUs
    # bf16 with channels_last.
    "fast-cifar": {
        "batch_size": 1024,
        "reference_batch_size": 1024,
        "lr": 0.4,
        "warmup_epochs": 1.0,
        "epochs": 10,
        "label_smoothing": 0.2,
        "augment": "crop-flip",
        "crop_padding": 2,
        "weight_decay": 5e-4,
        "eval_batch_size": 2048,
        "cuda": {"precision": "bf16", "channels_last": True},
    },
    # A byte-level language model on text read at run time (the standard library's sources by
    # default): AdamW with a short warmup, one pass, 231 steps of 32 sequences of 128 bytes
    # (200 s under fsdp on 2 processes of a 2-core CPU that was running other jobs too).
    "gpt": {
        "data": "text",
        "optimizer": "adamw",
        "lr": 3e-3,
        "weight_decay": 0.01,
        "batch_size": 32,
        "reference_batch_size": 32,
        "warmup_epochs": 0.1,
        "epochs": 1,
        "eval_batch_size": 64,
    },
}


def model_options(cfg: TrainConfig) -> dict[str, Any]:
    """What `models.build` passes the model's builder besides its shape: the gpt flags."""
    if cfg.model != "gpt":
        return {}
    return {
        "width": cfg.gpt_width,
        "depth": cfg.gpt_depth,
        "heads": cfg.gpt_heads,
        "dropout": cfg.gpt_dropout,
        "style": cfg.gpt_style,
        "kv_heads": cfg.gpt_kv_heads,
        "hidden": cfg.gpt_hidden,
    }


def recipe(model: str, device_type: str) -> dict[str, Any]:
    """The defaults `--model` brings on `device_type` ('cpu' or 'cuda')."""
    values = dict(RECIPES.get(model, {}))
    gpu = values.pop("cuda", {})
    return {**values, **(gpu if device_type == "cuda" else {})}


def layered(config_file: str | None, model: str | None, device: str | None) -> TrainConfig:
    """The defaults the command line then overrides, lowest first: the built-in ones, the
    model's recipe (its GPU part only when `device` resolves to CUDA), the YAML file."""
    from_file = load_config_file(config_file) if config_file else {}
    model = model or from_file.get("model", TrainConfig.model)
    # Only a recipe with a GPU part needs to know the device now; the plan resolves it anyway.
    gpu_part = "cuda" in RECIPES.get(model, {})
    device_type = devices.device_type(device or from_file.get("device", TrainConfig.device)) if gpu_part else "cpu"
    return TrainConfig(**{**recipe(model, device_type), **from_file})


def load_config_file(path: str) -> dict[str, Any]:
    """Options from a YAML file, keys with '-' or '_', values checked against TrainConfig's types."""
    import yaml  # 7 ms, for --config alone

    try:
        # Bytes, so that PyYAML picks the encoding as YAML says (UTF-8, or UTF-16/32 with a byte
        # order mark) and reports anything else as a YAML error, not a UnicodeDecodeError.
        with open(path, "rb") as f:
            raw = _safe_load_bounded(f, path)
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it ({err.strerror})") from None
    except yaml.reader.ReaderError:
        raise UsageError(f"--config {path}: not a YAML text file (UTF-8, or UTF-16 with a byte order mark)") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise UsageError(f"--config {path}: not valid YAML{at}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(raw).__name__}")
    types = typing.get_type_hints(TrainConfig)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise UsageError(f"--config {path}: unknown option {checks.shown(key)}")
        values[name] = _coerce(path, key, value, types[name])
    return values


# The most values a --config file may hold once its aliases (*name) are expanded: a real one
# holds a few dozen, and nine lines of nested aliases can stand for billions.
MAX_CONFIG_VALUES = 10_000


def _safe_load_bounded(stream: Any, path: str) -> Any:
    """yaml.safe_load, refusing a document whose aliases expand beyond MAX_CONFIG_VALUES values
    (counted on the composed nodes before any Python object is made: each shared node once)."""
    import yaml  # 7 ms, for --config alone

    loader = yaml.SafeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:
            if id(n) not in sizes:
                sizes[id(n)] = 1  # a node that contains itself counts once
                if isinstance(n, yaml.SequenceNode):
                    sizes[id(n)] = 1 + sum(size(child) for child in n.value)
                elif isinstance(n, yaml.MappingNode):
                    sizes[id(n)] = 1 + sum(size(k) + size(v) for k, v in n.value)
            return min(sizes[id(n)], MAX_CONFIG_VALUES + 1)

        if size(node) > MAX_CONFIG_VALUES:
            raise UsageError(
                f"--config {path}: more than {MAX_CONFIG_VALUES:,} values once its aliases (*name) are expanded; "
                "a configuration is a mapping of option: value"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _coerce(path: str, key: str, value: Any, kind: Any) -> Any:
    allowed = typing.get_args(kind) or (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    wanted = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise UsageError(f"--config {path}: {key} should be {wanted}, got {checks.shown(value)}")
