"""What one `ddpkit find-batch-size` search runs, resolved and checked before any worker
starts: the model and its input, precision and optimizer, the sizes to try, and where the
processes run (the same `launcher.topology` resolution as `ddpkit train`)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import data, models
from .. import strategy as strategies
from ..core import checks
from ..core.files import check_writable
from ..core.precision import PRECISIONS
from ..errors import UsageError
from ..launcher import Topology
from ..launcher import topology as topologies
from ..optim import OPTIMIZERS
from .search import CRITERIA

# the strategies a search runs (ddp on one process is the bare model)
TUNE_STRATEGIES = tuple(name for name, cls in sorted(strategies.REGISTRY.items()) if cls.tunable)


@dataclass(frozen=True)
class Settings:
    """What one search runs; checked on construction, so bad input fails before any worker
    starts (workers receive it pickled, and unpickling runs no check)."""

    model: str = "cnn"
    data: str = "digits"
    in_shape: tuple[int, ...] = (1, 8, 8)  # gpt: (context,)
    num_classes: int = 10  # gpt: the vocabulary
    gpt_width: int = models.GPT_WIDTH  # --model gpt's shape (as ddpkit train's --gpt-* flags)
    gpt_depth: int = models.GPT_DEPTH
    gpt_heads: int = models.GPT_HEADS
    gpt_style: str = "gpt2"
    gpt_kv_heads: int | None = None  # None: as many as --gpt-heads
    gpt_hidden: int | None = None  # None: the style's default MLP width
    device: str = "auto"
    precision: str = "fp32"
    optimizer: str = "sgd"
    strategy: str = "ddp"
    mesh: str | None = None  # the processes' layout (hsdp: replicate=R,dp=D)
    pp_schedule: str = "1f1b"  # pp: each size is a data rank's step, cut into one micro-batch per stage
    start: int = 1
    max_batch: int = 65536
    steps: int = 5
    warmup: int = 2
    criterion: str = "auto"  # auto (largest on CUDA, knee on CPU), largest or knee
    plateau: int = 2  # knee search: stop doubling after this many sizes in a row without gain
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        checks.choice("--precision", self.precision, PRECISIONS)
        checks.choice("--optimizer", self.optimizer, OPTIMIZERS)
        checks.choice("--strategy", self.strategy, TUNE_STRATEGIES)
        checks.choice("--criterion", self.criterion, ("auto", *CRITERIA))
        checks.choice("--pp-schedule", self.pp_schedule, strategies.SCHEDULES)
        for flag, value in (
            ("--start", self.start),
            ("--max-batch", self.max_batch),
            ("--steps", self.steps),
            ("--num-classes", self.num_classes),
            ("--gpt-width", self.gpt_width),
            ("--gpt-depth", self.gpt_depth),
            ("--gpt-heads", self.gpt_heads),
        ):
            checks.positive(flag, value)
        shape = models.gpt_shape_error(
            self.gpt_width, self.gpt_heads, self.gpt_kv_heads, self.gpt_style, self.gpt_hidden
        )
        if shape and self.language:  # (another model's gpt flags: data.check_applies)
            raise UsageError(shape)
        if self.start > self.max_batch:
            raise UsageError(f"--start {self.start} is larger than --max-batch {self.max_batch}")
        checks.at_least("--warmup", self.warmup, 0)
        checks.at_least("--plateau", self.plateau, 0)
        models.check(self.model, self.in_shape, self.num_classes)

    def resolved_criterion(self, device_type: str) -> str:
        return criterion_for(self.criterion, device_type)

    @property
    def language(self) -> bool:
        """A language model: (B, T) tokens to (B, T, vocabulary) logits."""
        return self.model in models.LANGUAGE_MODELS

    def model_options(self) -> dict[str, Any]:
        """What `models.build` passes the builder besides the shape (gpt's, as ddpkit train's)."""
        if not self.language:
            return {}
        shape = ("width", "depth", "heads", "style", "kv_heads", "hidden")
        return {name: getattr(self, f"gpt_{name}") for name in shape}


def criterion_for(criterion: str, device_type: str) -> str:
    """`auto` is the largest size that fits on CUDA, and the knee on CPU."""
    if criterion != "auto":
        return criterion
    return "largest" if device_type == "cuda" else "knee"


def resolve(a: Any, given: Sequence[str] = ()) -> tuple[Settings, Topology]:
    """The search and its processes from the parsed command line (`cli.find_batch_size`);
    `given`: the settings set away from their defaults there."""
    topology = topologies.resolve(a.device, a.nproc)
    mesh = None if a.mesh is None else strategies.MeshSpec.parse(a.mesh)
    strategy = strategies.for_mesh(a.strategy, mesh)  # --mesh replicate=2,dp=2: hsdp
    checks.choice("--strategy", strategy, TUNE_STRATEGIES)
    layout = strategies.mesh_for(strategies.by_name(strategy), mesh, topology.world_size, topology.nproc)
    language = a.model in models.LANGUAGE_MODELS
    default = "text" if language else "digits"
    name = checks.choice("--data", default if a.data is None else a.data, data.DATASETS)
    data.check_pairing(name, a.model, language)
    in_shape, classes = data.shape_of(
        name,
        checks.shape("--synthetic-shape", a.synthetic_shape),
        a.num_classes,
        checks.positive("--seq-len", a.seq_len),
    )
    if name == "synthetic":  # one float32 sample at least must fit, or no batch can be tried
        checks.memory(f"one sample of --synthetic-shape {a.synthetic_shape}", 4 * math.prod(in_shape))
    # A default start never exceeds a small --max-batch; a --start that does is refused.
    cuda = topology.device_type == "cuda"
    start = a.start if a.start is not None else min(8 if cuda else 1, max(1, a.max_batch))
    settings = Settings(
        model=a.model,
        data=name,
        in_shape=in_shape,
        num_classes=classes,
        device=topology.device_type,
        precision=a.precision,
        optimizer=a.optimizer,
        **{
            f"gpt_{n}": getattr(a, f"gpt_{n}")
            for n in ("width", "depth", "heads", "style", "kv_heads", "hidden")
            if getattr(a, f"gpt_{n}") is not None
        },
        strategy=strategy,
        mesh=None if mesh is None else str(mesh),
        pp_schedule=a.pp_schedule,
        start=start,
        max_batch=a.max_batch,
        steps=a.steps,
        warmup=a.warmup,
        criterion=criterion_for(a.criterion, topology.device_type),
        plateau=a.plateau,
    )  # (which checks the model: built and run once)
    data.check_applies(name, a.model, language, given)
    if language:
        per_weight = strategies.by_name(strategy).bytes_per_weight(topology.world_size)
        shape = {k: v for k, v in settings.model_options().items() if k not in ("width", "depth")}
        models.check_gpt_memory(
            in_shape[0], classes, settings.gpt_width, settings.gpt_depth, per_weight, topology.nproc, **shape
        )
    _check_layout(settings, layout)
    if a.plot and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {a.plot}: expected a .png file name")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path:  # fail now, not after the search
            checks.output_file(flag, path)
            check_writable(f"{flag} {path}", os.path.dirname(path))
    return settings, topology


def _check_layout(s: Settings, layout: strategies.MeshSpec) -> None:
    """Under tp, that the model has a tensor-parallel plan for the mesh's tp size; under pp,
    that it splits into its stages and that each size can fill them: checked on the model built
    on the meta device (shapes, no memory), before any worker starts."""
    tp, pp = layout.size("tp"), layout.size("pp")
    if tp == 1 and pp == 1:
        return
    model = models.build_shapes(s.model, s.in_shape, s.num_classes, **s.model_options())
    strategies.check_model(layout, model, s.model, s.precision)
    if pp > 1 and s.pp_schedule == "1f1b" and s.max_batch < pp:
        raise UsageError(
            f"--mesh {layout}: 1f1b needs at least {pp} samples per data rank, one micro-batch per stage; "
            f"--max-batch is {s.max_batch} (or use --pp-schedule gpipe)"
        )
