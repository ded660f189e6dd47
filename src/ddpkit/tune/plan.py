"""What one `ddpkit find-batch-size` search runs, resolved and checked before any worker
starts: the model and its input, precision and optimizer, the sizes to try, and where the
processes run (the same `launcher.topology` resolution as `ddpkit train`)."""

from __future__ import annotations

import math
import os
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
    in_shape: tuple[int, ...] = (1, 8, 8)
    num_classes: int = 10
    device: str = "auto"
    precision: str = "fp32"
    optimizer: str = "sgd"
    strategy: str = "ddp"
    mesh: str | None = None  # the processes' layout (hsdp: replicate=R,dp=D)
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
        for flag, value in (
            ("--start", self.start),
            ("--max-batch", self.max_batch),
            ("--steps", self.steps),
            ("--num-classes", self.num_classes),
        ):
            checks.positive(flag, value)
        if self.start > self.max_batch:
            raise UsageError(f"--start {self.start} is larger than --max-batch {self.max_batch}")
        checks.at_least("--warmup", self.warmup, 0)
        checks.at_least("--plateau", self.plateau, 0)
        models.check(self.model, self.in_shape, self.num_classes)

    def resolved_criterion(self, device_type: str) -> str:
        return criterion_for(self.criterion, device_type)


def criterion_for(criterion: str, device_type: str) -> str:
    """`auto` is the largest size that fits on CUDA, and the knee on CPU."""
    if criterion != "auto":
        return criterion
    return "largest" if device_type == "cuda" else "knee"


def resolve(a: Any) -> tuple[Settings, Topology]:
    """The search and its processes from the parsed command line (`cli.find_batch_size`)."""
    topology = topologies.resolve(a.device, a.nproc)
    mesh = None if a.mesh is None else strategies.MeshSpec.parse(a.mesh)
    strategy = strategies.for_mesh(a.strategy, mesh)  # --mesh replicate=2,dp=2: hsdp
    refusal = strategies.REGISTRY[strategy].refuses_search if strategy in strategies.REGISTRY else ""
    if refusal:
        named = f"--mesh {mesh}: it runs --strategy {strategy}" if strategy != a.strategy else f"--strategy {strategy}"
        raise UsageError(
            f"{named}; find-batch-size does not search under it yet ({refusal}); use --strategy ddp, fsdp or hsdp"
        )
    checks.choice("--strategy", strategy, TUNE_STRATEGIES)
    strategies.mesh_for(strategies.by_name(strategy), mesh, topology.world_size, topology.nproc)
    # Language models (--model gpt on --data text) are not probed yet: the probe feeds images.
    name = checks.choice("--data", a.data, [d for d in data.DATASETS if d not in data.TEXT_DATASETS])
    if a.model in models.LANGUAGE_MODELS:
        raise UsageError(f"--model {a.model}: ddpkit find-batch-size does not search for language models yet")
    in_shape, classes = data.shape_of(name, checks.shape("--synthetic-shape", a.synthetic_shape), a.num_classes)
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
        strategy=strategy,
        mesh=None if mesh is None else str(mesh),
        start=start,
        max_batch=a.max_batch,
        steps=a.steps,
        warmup=a.warmup,
        criterion=criterion_for(a.criterion, topology.device_type),
        plateau=a.plateau,
    )
    if a.plot and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {a.plot}: expected a .png file name")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path:  # fail now, not after the search
            checks.output_file(flag, path)
            check_writable(f"{flag} {path}", os.path.dirname(path))
    return settings, topology
