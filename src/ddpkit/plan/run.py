"""The plan of one job on one cluster: its layouts traced and predicted, the best, its command."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tqdm import tqdm

from .. import models
from ..core import checks
from ..errors import UsageError
from ..observe.collectives import Op
from .cluster import Cluster
from .predict import Prediction, best, layouts, predict
from .trace import Layout, Step, Trace, fake_world, isolated, trace

# Imports inside functions: torch's fake-tensor and FLOP-counting modules load when a plan runs.


@dataclass(frozen=True)
class Spec:
    """The job: a model (built-in, with gpt's shape, or `package.module:function`), its input
    shape and classes (gpt: (seq_len,) and the vocabulary), the global batch, precision and
    optimizer."""

    model: str = "gpt"
    in_shape: tuple[int, ...] = (1024,)
    num_classes: int = 256
    global_batch: int = 64
    precision: str = "bf16"
    optimizer: str = "adamw"
    options: dict[str, Any] = field(default_factory=dict)  # gpt: width, depth, heads
    checkpointing: tuple[bool, ...] = (False, True)

    def __post_init__(self) -> None:
        checks.positive("--batch-size", self.global_batch)
        checks.choice("--precision", self.precision, ("fp32", "bf16", "fp16"))
        checks.choice("--optimizer", self.optimizer, ("adamw", "sgd"))

    @property
    def language(self) -> bool:
        return self.model in models.LANGUAGE_MODELS

    def build(self) -> torch.nn.Module:
        return models.build(self.model, self.in_shape, self.num_classes, **self.options)

    def builder(self, **options: Any) -> Callable[[], torch.nn.Module]:
        """`build` with some options changed (gpt's depth, to extrapolate)."""
        return lambda: models.build(self.model, self.in_shape, self.num_classes, **{**self.options, **options})

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.language:
            tokens = torch.randint(0, self.num_classes, (n, *self.in_shape))
            return tokens, tokens
        return torch.randn(n, *self.in_shape), torch.randint(0, self.num_classes, (n,))

    def share(self, data_ranks: int) -> int | None:
        """A data rank's samples per step; None where the global batch does not divide."""
        return self.global_batch // data_ranks if self.global_batch % data_ranks == 0 else None


@dataclass
class Plan:
    spec: Spec
    cluster: Cluster
    parameters: int
    predictions: list[Prediction]
    seconds: float

    @property
    def best(self) -> Prediction | None:
        return best(self.predictions)

    def command(self, p: Prediction) -> str:
        return command(self.spec, self.cluster, p.layout)


def plan(spec: Spec, cluster: Cluster, progress: bool = False) -> Plan:
    """Trace and predict every layout of `spec` on `cluster`: for each, the largest
    micro-batch (a power of two dividing a data rank's share, or the share itself) that fits."""
    start = time.perf_counter()
    heads = spec.options.get("heads", models.GPT_HEADS) if spec.language else None
    todo = layouts(cluster, spec.share, heads, spec.checkpointing)
    if not todo:
        raise UsageError(
            f"--batch-size {spec.global_batch} does not divide over the {cluster.world_size} GPUs' data ranks "
            "in any layout: give a multiple of the GPU count"
        )
    parameters, predictions = isolated(_traced_all, spec, cluster, todo, progress)
    return Plan(spec, cluster, parameters, predictions, time.perf_counter() - start)


def _traced_all(spec: Spec, cluster: Cluster, todo: list[Layout], progress: bool) -> tuple[int, list[Prediction]]:
    """In a process of its own (see `isolated`): the model's size, and each layout's prediction."""
    with fake_world(cluster.world_size):
        parameters, per_sample = _size(spec)
        bar = tqdm(todo, desc="ddpkit plan", unit="layout", disable=not progress, leave=False)
        return parameters, [_fitted(spec, cluster, layout, per_sample) for layout in bar]


def _size(spec: Spec) -> tuple[int, float]:
    """The model's parameters, and its training FLOPs per sample (forward and backward, no
    recomputation), counted on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = spec.build()
        x, y = spec.batch(1)
        counter = FlopCounterMode(display=False)
        with counter:
            torch.nn.functional.cross_entropy(model(x).flatten(0, -2).float(), y.flatten()).backward()
        return sum(p.numel() for p in model.parameters()), float(counter.get_total_flops())


def _fitted(spec: Spec, cluster: Cluster, layout: Layout, per_sample: float) -> Prediction:
    """`layout`'s prediction at the largest micro-batch that fits (the smallest if none does)."""
    share = spec.share(layout.spec.data_size)
    assert share is not None
    step = Step(spec.build, spec.batch, share, spec.precision, spec.optimizer)
    seq = spec.in_shape[0] if spec.language else None
    prediction = None
    for micro in _micro_batches(share):
        sized = replace(layout, micro_batch=micro)
        prediction = predict(
            _traced(spec, step, sized, cluster.world_size),
            sized,
            cluster,
            spec.precision,
            spec.global_batch,
            seq,
            per_sample * spec.global_batch,
        )
        if prediction.fits:
            break
    assert prediction is not None
    return prediction


# gpt deeper than this is traced at 2 and 3 blocks and extrapolated (a whole trace's time grows
# with the depth; at 8 blocks the extrapolated peaks were within 4% of whole traces, with activation
# checkpointing, and equal without).
EXTRAPOLATE_FROM = 8


def _traced(spec: Spec, step: Step, layout: Layout, world_size: int) -> Trace:
    """`trace`, of gpt at one and two blocks extrapolated to its depth where it has more: every
    block adds the same parameters, states, activations, FLOPs and collectives (the test
    suite checks the extrapolation against a whole trace)."""
    depth = spec.options.get("depth", models.GPT_DEPTH) if spec.language else 0
    if depth <= EXTRAPOLATE_FROM:
        return trace(step, layout, world_size)
    one, two = (trace(replace(step, build=spec.builder(depth=d)), layout, world_size) for d in (2, 3))
    n = depth - 2
    memory = {k: one.memory[k] + n * (two.memory[k] - one.memory[k]) for k in one.memory}
    ops = _extrapolated_ops(one.ops, two.ops, n)
    computed = [*one.computed, f"gpt: traced at 2 and 3 blocks, extrapolated to {depth}"]
    peak = one.peak + n * (two.peak - one.peak)
    return Trace(memory, peak, ops, one.flops + n * (two.flops - one.flops), computed)


def _extrapolated_ops(one: list[Op], two: list[Op], n: int) -> list[Op]:
    """The collectives at `n` more blocks than `one`'s: per kind and group, the calls and the
    bytes grow by `two`'s excess over `one` for each block (a whole-model collective, DDP's
    all-reduce, grows in bytes; a per-block one in calls), as calls of equal size."""
    out = []
    for key in dict.fromkeys((op.kind, op.ranks) for op in [*one, *two]):
        c1, c2 = (sum(1 for op in ops if (op.kind, op.ranks) == key) for ops in (one, two))
        b1, b2 = (sum(op.bytes for op in ops if (op.kind, op.ranks) == key) for ops in (one, two))
        calls, size = c1 + n * (c2 - c1), b1 + n * (b2 - b1)
        out += [Op(key[0], size // calls, key[1])] * calls if calls > 0 else []
    return out


def _micro_batches(share: int) -> list[int]:
    """The share itself, then the powers of two below it that divide it, largest first."""
    sizes, m = [share], 1
    while m < share:
        if share % m == 0:
            sizes.append(m)
        m *= 2
    return sorted(set(sizes), reverse=True)


def command(spec: Spec, cluster: Cluster, layout: Layout) -> str:
    """The `ddpkit train` command line that runs `layout` of `spec` on `cluster` (run on every
    node, with that node's rank, where there are several)."""
    parts = ["ddpkit train", f"--model {spec.model}"]
    if spec.language:
        parts += ["--data text", f"--seq-len {spec.in_shape[0]}"]
        parts += [f"--gpt-{name} {value}" for name, value in spec.options.items()]
    parts += ["--device cuda", f"--nproc {cluster.gpus_per_node}"]
    if cluster.nodes > 1:
        parts += [
            f"--nnodes {cluster.nodes}",
            f"--node-rank <0..{cluster.nodes - 1}>",
            "--master-addr <node 0>",
        ]
    parts += [f"--strategy {layout.strategy}"]
    if layout.strategy != "ddp" and layout.mesh != f"dp={cluster.world_size}":
        parts += [f"--mesh {layout.mesh}"]
    parts += [f"--batch-size {spec.global_batch}", f"--precision {spec.precision}", f"--optimizer {spec.optimizer}"]
    share = spec.share(layout.spec.data_size)
    if share and layout.micro_batch < share:
        parts += [f"--micro-batch-size {layout.micro_batch}"]
    if layout.checkpointing:
        parts += ["--activation-checkpointing true"]
    return " ".join(parts)
