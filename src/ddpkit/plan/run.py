"""The plan of one job on one cluster: its layouts traced and predicted, the best, its command."""

from __future__ import annotations

import math
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
from .cluster import GIB, Cluster
from .predict import STRATEGIES, Prediction, best, layouts, predict
from .trace import Layout, Step, Trace, backend_for, built, child_flops, flops, in_fake_worlds, trace, workers

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
    options: dict[str, Any] = field(default_factory=dict)  # gpt: width, depth, heads, style, kv_heads, hidden
    checkpointing: tuple[bool | str, ...] = (False, True)  # True: full; "selective"
    data: str = ""  # the dataset the shape came from, for the train command ("": gpt's text, else synthetic)
    strategies: tuple[str, ...] = ()  # plan only these (ddp, fsdp, hsdp, tp); () plans all

    def __post_init__(self) -> None:
        checks.positive("--batch-size", self.global_batch)
        if not self.checkpointing:
            raise UsageError("activation checkpointing: plan with it, without it, or both (not neither)")
        for name in self.strategies:
            checks.choice("--strategy", name, STRATEGIES)
        for how in self.checkpointing:
            if how not in (False, True, "selective"):
                raise UsageError(f"activation checkpointing: False, True (full) or 'selective', not {how!r}")
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
    heads = None  # what tp's size must divide: gpt's heads, key/value heads and vocabulary
    if spec.language:
        h = spec.options.get("heads", models.GPT_HEADS)
        heads = math.gcd(h, spec.options.get("kv_heads") or h, spec.num_classes)
    todo = layouts(cluster, spec.share, heads, spec.checkpointing, _stages(spec))
    if spec.strategies and todo:
        todo = [layout for layout in todo if layout.strategy in spec.strategies]
        if not todo:
            raise UsageError(
                f"--strategy {','.join(spec.strategies)}: no such layout runs here (hsdp needs several nodes "
                "and GPUs per node; tp needs heads, and a global batch, that divide; pp a gpt with a child "
                "per stage, stages of 2 or more GPUs that divide the GPUs, not fp16)"
            )
    if not todo:
        raise UsageError(
            f"--batch-size {spec.global_batch} does not divide over the {cluster.world_size} GPUs' data ranks "
            "in any layout: give a multiple of the GPU count"
        )
    parts = _parts(todo, workers())
    tqdm.monitor_interval = 0  # no monitor thread: the traces' processes are forked where it is safe
    bar = tqdm(total=len(parts) + 1, desc="ddpkit plan", unit="part", disable=not progress, leave=False)
    with bar:
        calls: list[tuple[Any, tuple[Any, ...]]] = [(_traced_fits, (spec, cluster, part)) for part in parts]
        calls.append((_size, (spec,)))  # the cheapest last: the processes end nearer together
        *traced, (parameters, per_sample, children) = in_fake_worlds(cluster.world_size, calls, bar)
    fitted = {layout: one for part, results in zip(parts, traced) for layout, one in zip(part, results)}
    predictions = [_predicted(spec, cluster, fitted[layout], per_sample, children) for layout in todo]
    return Plan(spec, cluster, parameters, predictions, time.perf_counter() - start)


# The strategies' traces by cost, dearest first (`_parts`): tensor parallelism's take an untracked
# step more (`trace._warm_up`) and DTensor's sharding of every operation; a pipeline's, a trace
# per stage; FSDP2's, of its optimizer's step; DDP's are the bare model's.
COSTLIEST_FIRST = ("tp", "pp", "hsdp", "fsdp", "ddp")


def _stages(spec: Spec) -> int:
    """The most stages a pipeline of `spec`'s model is planned with (0: none): a gpt's children
    (its embedding, blocks and head); not in fp16, which a pipeline does not run. A gpt deeper
    than EXTRAPOLATE_FROM blocks only where pipelines are asked for (`--strategy pp`): each
    stage traced is traced twice, at fewer blocks (`_traced_stage`), over a whole step's
    micro-batches, and a 32-rank plan of a 24-block gpt took 278 s with them (docs/plan.md)."""
    if not spec.language or spec.precision == "fp16":
        return 0
    if _depth(spec) > EXTRAPOLATE_FROM and "pp" not in spec.strategies:
        return 0
    return children(spec)


def children(spec: Spec) -> int:
    """The children a pipeline splits `spec`'s model between (gpt: its embedding, its blocks
    and its head; 0 for another model)."""
    return _depth(spec) + 2 if spec.language else 0


def _parts(todo: list[Layout], workers: int) -> list[list[Layout]]:
    """`todo` in the parts that one process traces in turn (`_traced_fits`), the costliest
    first: one per strategy and mesh (its layouts with and without checkpointing, in `todo`'s
    order; DDP's layout by layout: it shares nothing) where those are enough to keep the
    `workers` busy, else one per layout.

    DTensor works out an operation's sharding the first time it meets it on a mesh, and caches
    it in the process: a mesh's traces in one process work it out once. The model at 3 blocks,
    traced without checkpointing and then with it, finds it worked out but for checkpointing's
    own (a detach), the optimizer's step too, whose list of every parameter costs most to work
    out (0.7 to 1.1 s of a 2 s trace, on a 2-D mesh). One layout to a call, a mesh's layouts
    were spread over the processes, and the last (the dearest) left one process alone for the
    last 2.8 s of a 512-rank plan's 17.6 s."""
    parts: dict[Any, list[Layout]] = {}
    for layout in todo:
        parts.setdefault(layout if layout.strategy == "ddp" else (layout.strategy, layout.mesh), []).append(layout)
    chosen = list(parts.values()) if len(parts) + 1 >= workers else [[layout] for layout in todo]
    return sorted(chosen, key=lambda part: COSTLIEST_FIRST.index(part[0].strategy))


def _size(spec: Spec) -> tuple[int, dict[bool, float], Children]:
    """The model's parameters (built on the meta device, or on fake tensors where it cannot
    be: nothing allocated, see `trace.built`) and its training FLOPs per sample, without and
    with activation checkpointing (a deep gpt's extrapolated from TRACED_DEPTHS blocks, as its
    traces are); and where it is planned as pipelines (`_stages`), each child's parameters and
    FLOPs per sample, which its stages split."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    depth = _depth(spec)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if depth <= EXTRAPOLATE_FROM:
        parameters = _parameters(spec.build, mode)
    else:  # every block alike: built whole, 20,000 blocks took minutes even on fake tensors
        low, high = TRACED_DEPTHS[True]
        one, two = (_parameters(spec.builder(depth=d), mode) for d in (low, high))
        parameters = one + (depth - low) * (two - one)
    per_sample = {}
    for ac in dict.fromkeys((False, *spec.checkpointing)):
        if depth <= EXTRAPOLATE_FROM:
            per_sample[ac] = flops(spec.build, spec.batch, ac)
        else:
            low, high = TRACED_DEPTHS[True]
            one, two = (flops(spec.builder(depth=d), spec.batch, ac) for d in (low, high))
            per_sample[ac] = one + (depth - low) * (two - one)
    return parameters, per_sample, _children(spec, mode) if _stages(spec) else ({}, {})


# A pipelined model's children: their parameters (what `strategy.pp.split` balances the stages
# by) and their FLOPs per sample by activation checkpointing, both by name in the model's order.
Children = tuple[dict[str, int], dict[bool | str, dict[str, float]]]


def _children(spec: Spec, mode: Any) -> Children:
    """`Children` of `spec`'s gpt, from a gpt of one block: every block is alike, the
    embedding's and the head's do not depend on the depth."""
    one = spec.builder(depth=1)
    by_ac = {ac: _as_deep(spec, child_flops(one, spec.batch, ac)) for ac in dict.fromkeys((False, *spec.checkpointing))}
    return _child_sizes(spec, mode), by_ac


def _child_sizes(spec: Spec, mode: Any) -> dict[str, int]:
    """The parameters of each child of `spec`'s gpt (what `strategy.pp.split` cuts by), from a
    gpt of one block built as a trace builds it."""
    model, _ = built(spec.builder(depth=1), mode)
    return _as_deep(spec, {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()})


def _as_deep(spec: Spec, one: dict[str, Any]) -> dict[str, Any]:
    """A figure of each child of a gpt of one block (`one`), as `spec`'s gpt has its children:
    its block's for every block."""
    return {
        "embed": one["embed"],
        **dict.fromkeys((f"block{i}" for i in range(_depth(spec))), one["block0"]),
        "head": one["head"],
    }


def stage_cuts(spec: Spec, stages: int) -> list[tuple[bool, int, bool]]:
    """Each of `stages` stages of `spec`'s gpt as `strategy.pp.split` cuts it (by parameters):
    whether it holds the embedding, how many blocks, whether it holds the head."""
    names, bounds = _stage_bounds(spec, stages)
    return [
        (low == 0, len(range(max(low, 1), min(high, len(names) - 1))), high == len(names))
        for low, high in zip(bounds, bounds[1:])
    ]


def stage_flops(children: Children, checkpointing: bool | str, stages: int) -> list[float]:
    """The FLOPs per sample of each of `stages` stages, cut as `strategy.pp.split` cuts them."""
    from ..strategy.pp import balanced_cuts

    sizes, by_ac = children
    names, counted = list(sizes), by_ac[checkpointing]
    bounds = balanced_cuts([sizes[n] for n in names], stages)
    return [sum(counted[n] for n in names[bounds[s] : bounds[s + 1]]) for s in range(stages)]


def _parameters(build: Any, mode: Any) -> int:
    """The parameters of the model `build` makes, built as a trace builds it (`trace.built`)."""
    model, _ = built(build, mode)
    return sum(p.numel() for p in model.parameters())


def _depth(spec: Spec) -> int:
    return spec.options.get("depth", models.GPT_DEPTH) if spec.language else 0


def _traced_fits(spec: Spec, cluster: Cluster, part: list[Layout]) -> list[tuple[Layout, Trace]]:
    """In a fake world: each of `part`'s layouts (see `_parts`) traced in turn, each at the
    largest micro-batch that fits (the smallest if none does)."""
    return [_traced_fit(spec, cluster, layout) for layout in part]


def _traced_fit(spec: Spec, cluster: Cluster, layout: Layout) -> tuple[Layout, Trace]:
    share = spec.share(layout.spec.data_size)
    assert share is not None
    step = Step(
        spec.build,
        spec.batch,
        share,
        spec.precision,
        spec.optimizer,
        count=bool(cluster.gpu.memory_gbps),  # a processor measured here: every operation (`work`)
        backend=backend_for(cluster.gpu.device),  # `--gpu cpu`: gloo (see `trace.GlooCopies`)
    )
    if layout.strategy == "pp":
        return _traced_pipeline(spec, cluster, layout, step)
    memory = cluster.gpu.memory_gib * GIB
    # A micro-batch whose input alone (4 bytes a value at least) exceeds the GPU cannot fit:
    # not traced (with --batch-size 2**62 its tensors' sizes overflowed int64 in the trace)
    sizes = _micro_batches(share)
    sizes = [m for m in sizes if m * math.prod(spec.in_shape) * 4 <= memory] or sizes[-1:]
    for micro in sizes:
        sized = replace(layout, micro_batch=micro)
        traced = _traced(spec, step, sized, cluster.world_size)
        # It fits; or the states alone (parameters, gradients, optimizer state, communication
        # buffers: no smaller with a smaller micro-batch) do not, at any micro-batch. Temporaries
        # shrink with it too (the logits and their gradient): counted as states, a 0.07 GiB
        # layout at mb1 was reported as needing 0.42 GiB at mb16, and "no layout fits".
        if traced.peak <= memory or traced.peak - traced.memory["activations"] - traced.memory["temporary"] > memory:
            break
    return sized, traced


def _traced_pipeline(spec: Spec, cluster: Cluster, layout: Layout, step: Step) -> tuple[Layout, Trace]:
    """A pipeline's every stage (`_stage_traces`: traced by `pipeline.trace_stage`, torch's 1f1b,
    or gpipe, over the step's micro-batches, or interpolated between two stages alike, or posed
    where few micro-batches are in flight), at the
    micro-batch `_pipeline_micro_batches` prefers that fits on every stage (the smallest if none
    does): the trace of the stage that holds most, the others' peaks said beside it."""
    stages = layout.spec.size("pp")
    memory = cluster.gpu.memory_gib * GIB
    sizes = _pipeline_micro_batches(step.share, stages, layout.schedule)
    sizes = [m for m in sizes if m * math.prod(spec.in_shape) * 4 <= memory] or sizes[-1:]  # (see _traced_fit)
    cuts = stage_cuts(spec, stages)
    for micro in sizes:
        sized = replace(layout, micro_batch=micro)
        traces, traced, posed = _stage_traces(spec, step, sized, cluster.world_size, cuts)
        states = max(t.peak - t.memory["activations"] - t.memory["temporary"] for t in traces)
        if max(t.peak for t in traces) <= memory or states > memory:  # fits, or never will (_traced_fit)
            break
    worst = max(traces, key=lambda t: t.peak)
    schedules = {"1f1b": "ddpkit's default schedule", "gpipe": "fewer micro-batches than stages"}
    peaks = ", ".join(f"{t.peak / GIB:.3g}" for t in traces)
    shown = replace(worst, stages=traces)  # the step's time: each stage's, timed on its own (`predict`)
    if posed:
        which = (
            ("every stage" if not traced else f"stages {', '.join(map(str, traced))} traced (and any alike "
             "interpolated), every other one") + " posed (its children traced where a stage holds few micro-batches "
            f"in flight, over {POSED_MICRO_BATCHES} and {POSED_MICRO_BATCHES + 1}, extended to its own)"
        )  # fmt: skip
    elif len(traced) == stages:
        which = "every stage traced"
    else:
        which = (
            f"stages {', '.join(map(str, traced))} traced, each other one from the traced stages of the same children "
            "by the micro-batches it holds in flight (interpolated, or as the first where they hold as many)"
        )
    shown.computed = [
        f"pp: {which}, the one that holds most shown (peaks by stage: {peaks} GiB)",
        f"pp: {layout.schedule} over the step's micro-batches ({schedules[layout.schedule]}; under 1f1b a step of "
        "more than 2(P + 2) traced at P + 1 and P + 2, extrapolated, or posed); each stage timed on "
        "its own (its compute, sends and collectives), the slowest's time the step's, its FLOPs and collectives shown",
        *worst.computed[1:],  # (its own first line names its stage)
    ]
    return sized, shown


def in_flight(schedule: str, index: int, stages: int, chunks: int) -> int:
    """The micro-batches stage `index` of `stages` holds in flight at once over a step of
    `chunks`: every one under gpipe; under 1f1b, those of its warm-up, as torch's
    `Schedule1F1B` runs it (the first stage as many as there are stages, the last one)."""
    return chunks if schedule == "gpipe" else min(chunks, stages - index)


def _stage_traces(
    spec: Spec, step: Step, layout: Layout, world_size: int, cuts: list[tuple[bool, int, bool]]
) -> tuple[list[Trace], list[int], bool]:
    """Each stage's trace of `layout`'s pipeline, first stage first, the stages traced as
    themselves, and whether the others were posed.

    Stages that hold the same children (`cuts`: none of them the embedding or the head, and as
    many blocks) differ only in the micro-batches each holds in flight (`in_flight`). Of each
    such set, the stages that hold the most and the fewest are traced (`_traced_stage`; the
    first alone where all hold as many, as under gpipe); each other one is interpolated
    between them (`_between`): every role of its memory, and its peak, affine in the
    micro-batches in flight; its collectives the first one's, its DDP's all-reduce over its own
    ranks. So a pipeline of any depth costs a few traces, not one per stage. From POSED_FROM
    stages on, every set is posed instead (`_posed_stages`): its children traced where a stage
    holds few micro-batches in flight, over a few micro-batches."""
    stages = layout.spec.size("pp")
    chunks = max(1, step.share // layout.micro_batch)
    held = [in_flight(layout.schedule, s, stages, chunks) for s in range(stages)]
    alike: dict[tuple[bool, int, bool], list[int]] = {}
    for s, cut in enumerate(cuts):
        alike.setdefault(cut, []).append(s)
    posed: dict[int, Trace] = {}
    if layout.schedule == "1f1b" and stages >= POSED_FROM and chunks >= stages + 1:
        memo: dict[Any, Trace] = {}  # the sets' traces alike (middle sets of a deep gpt, traced at as many blocks)
        for same in alike.values():
            posed.update(_posed_stages(spec, step, layout, world_size, same, cuts, memo))
    # each set's first stage (it holds the most), and its last where that holds fewer (not under gpipe)
    last = {
        same[0]: same[-1] if held[same[-1]] != held[same[0]] else same[0]
        for same in alike.values()
        if same[0] not in posed
    }
    chosen = sorted(set(last) | set(last.values()))
    traced = {s: _traced_stage(spec, step, layout, world_size, s, cuts) for s in chosen}
    out = []
    for s in range(stages):
        first = alike[cuts[s]][0]
        if s in posed:
            out.append(posed[s])
        else:
            out.append(traced[s] if s in traced else _between(layout, traced, first, last[first], s, held))
    return out, chosen, bool(posed)


# From this many stages on, a pipeline's stages are posed (`_posed_stages`):
# below it, tracing them in their own places costs about as little, and is what the real runs
# of tests/plan/test_real_runs.py check.
POSED_FROM = 8
POSED_MICRO_BATCHES = 5  # the fewer of the two a posed stage is traced over


def _posed_stages(
    spec: Spec,
    step: Step,
    layout: Layout,
    world_size: int,
    same: list[int],
    cuts: list[tuple[bool, int, bool]],
    memo: dict[Any, Trace] | None = None,
) -> dict[int, Trace]:
    """The traces of the stages `same` (holding the same children) of a 1f1b pipeline of P
    stages over m micro-batches, from short traces of their children posed where a stage
    holds few micro-batches in flight.

    torch's `Schedule1F1B` runs a stage by two numbers alone (and by whether it is the first or
    the last): the micro-batches it holds in flight, k = P - s, and the step's m. So a middle
    stage's children are traced as stage P - 2 (k = 2) over 5 and 6 micro-batches and as stage
    P - 3 (k = 3) over 5; the first stage's as the first of a pipeline of 2 stages (k = 2) over
    5 and 6 and of 3 stages (k = 3) over 5, over the first ranks of the layout's pipeline; the
    last stage (k = 1 always) in its own place over 5 and 6. A fourth trace at k = 4 checks that
    the peaks came where the micro-batches in flight are held (`_affine`); where they did not,
    the set is left out: the caller traces its first and last stages in place and interpolates
    the others between them (where the peak moves along k, on the high side: the peak is then
    the larger of two lines, and a chord lies above it). Stage s is their affine extension
    to its k and m: every role of its memory, its collectives and its operations
    (`_extrapolated_ops`, `_extrapolated_work`), its DDP's all-reduce over its own ranks
    (`_moved`), its sends over the whole pipeline. Four traces of 5 or 6 micro-batches where
    its own place costs two of P + 1 and P + 2 (`_over_micro_batches`) for each stage traced
    (and under tp an untracked step of two micro-batches before each: `pipeline.ready`). A
    trace that an earlier set of the same pipeline ran (`memo`: a deep gpt's middle sets of
    different numbers of blocks are each traced at the same fewer) is not run again. The test
    suite checks posed stages against whole traces."""
    from .pipeline import pipeline_ranks, trace_stage

    stages, chunks = layout.spec.size("pp"), max(1, step.share // layout.micro_batch)
    a = POSED_MICRO_BATCHES
    low, high = TRACED_DEPTHS[bool(layout.checkpointing)]
    embed, blocks, head = cuts[same[0]]
    deep = _depth(spec) > EXTRAPOLATE_FROM and blocks > high
    kept_names = _stage_children(spec, stages, same[0]) if _depth(spec) <= EXTRAPOLATE_FROM else ()
    # (place, the stages it is the first of where the first stage is posed, micro-batches): at
    # k = 2 over a and a + 1, then at k = 3 and 4 over a (the check's); and the first's k
    if same[0] == 0:
        places, held = ((0, 2, a), (0, 2, a + 1), (0, 3, a), (0, 4, a)), 2
    elif same == [stages - 1]:
        places, held = ((stages - 1, None, a), (stages - 1, None, a + 1)), 1
    else:
        places, held = (
            ((stages - 2, None, a), (stages - 2, None, a + 1), (stages - 3, None, a), (stages - 4, None, a)),
            2,
        )
    home = places[0][0]
    posed_ranks, whole = pipeline_ranks(layout)[:2], pipeline_ranks(layout)
    where = (
        "as the first of 2, 3 and 4 stages"
        if home == 0
        else f"as stages {home}, {home - 1} and {home - 2}"
        if len(places) > 2
        else f"as stage {home}"
    )

    traces = {} if memo is None else memo

    def traced_at(place: int, first_of: int | None, m: int, depth: int | None) -> Trace:
        if depth is None:  # the model itself (no deeper than EXTRAPOLATE_FROM), its children as the stage's
            built_as, kept = replace(step, share=layout.micro_batch * m), kept_names
        else:
            kept = ("embed",) * embed + tuple(f"block{i}" for i in range(depth)) + ("head",) * head
            built_as = replace(step, build=spec.builder(depth=max(depth, 1)), share=layout.micro_batch * m)
        key = (place, first_of, m, depth, kept)  # (the middle sets of a deep gpt trace the same: `memo`)
        if key not in traces:
            traces[key] = trace_stage(built_as, layout, world_size, place, kept, first_of)
        return traces[key]

    def extended(depth: int | None) -> Callable[[int], Trace] | None:
        one = traced_at(*places[0], depth)
        rest = [traced_at(*place, depth) for place in places[2:]]
        if rest and not _affine(one, *rest):
            return None  # the peak's moment moved between 2, 3 and 4 in flight (see `_affine`)
        two, three = traced_at(*places[1], depth), (rest[0] if rest else None)
        ops, work = _extrapolated_ops(one.ops, two.ops, chunks - a), _extrapolated_work(one, two, chunks - a)
        if home == 0:  # the first stage's sends, over the pipeline of 2 it was posed in
            ops = [replace(op, ranks=whole) if op.ranks == posed_ranks else op for op in ops]

        def at(s: int) -> Trace:
            more = stages - s - held  # micro-batches in flight beyond the first trace's
            memory = {
                r: max(0.0, one.memory[r] + (chunks - a) * (two.memory[r] - one.memory[r])
                       + (more * (three.memory[r] - one.memory[r]) if three else 0.0))
                for r in one.memory
            }  # fmt: skip
            computed = [
                f"pp: stage {s} of {stages}",
                *two.computed[1:],
                f"pp: stage {s} posed: its children traced {where} over {a} and {a + 1} micro-batches, extended to "
                f"its {stages - s} in flight and the step's {chunks}",
            ]
            return Trace(memory, float(sum(memory.values())), _moved(layout, ops, home, s), 0.0, computed, work)

        return at

    if not deep:
        at = extended(None if _depth(spec) <= EXTRAPOLATE_FROM else blocks)
        return {s: at(s) for s in same} if at else {}
    shallow = extended(low)
    deeper = extended(high) if shallow is not None else None
    if shallow is None or deeper is None:
        return {}
    return {s: _deepened(layout, shallow(s), deeper(s), s, blocks, low, high) for s in same}


def _affine(one: Trace, two: Trace, three: Trace) -> bool:
    """Whether the traces of a stage at 2, 3 and 4 micro-batches in flight (`_posed_stages`)
    peaked where the micro-batches in flight are held, at the same moment of the step: their
    activations grow with them, and every role lies on one line. With few in flight the
    optimizer's step may hold the most, a moment that does not grow with them, which more in
    flight then overtake (seen: a first stage of 8 with checkpointing, its peak 2% low; a
    16-stage 3-D layout's worst stage, half). Not checked: the line along the micro-batches,
    nor two moments that both grow with them and cross beyond 4 in flight."""

    def close(x: float, y: float) -> bool:
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1.0)

    grows = two.memory["activations"] > one.memory["activations"]
    return grows and all(close(three.memory[r] - two.memory[r], two.memory[r] - one.memory[r]) for r in one.memory)


def _stage_children(spec: Spec, stages: int, index: int) -> tuple[str, ...]:
    """The names of the children stage `index` of `stages` holds, as `strategy.pp.split` cuts
    `spec`'s gpt (by parameters)."""
    names, bounds = _stage_bounds(spec, stages)
    return tuple(names[bounds[index] : bounds[index + 1]])


def _stage_bounds(spec: Spec, stages: int) -> tuple[list[str], list[int]]:
    """The names of `spec`'s gpt's children, and where `strategy.pp.split` cuts them into
    `stages` stages (by parameters: `balanced_cuts`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..strategy.pp import balanced_cuts

    sizes = _child_sizes(spec, FakeTensorMode(allow_non_fake_inputs=True))
    return list(sizes), balanced_cuts(list(sizes.values()), stages)


def _between(layout: Layout, traced: dict[int, Trace], first: int, last: int, s: int, held: list[int]) -> Trace:
    """Stage `s`'s trace from those of stages `first` and `last`, which hold the same children:
    its memory, role by role, and its peak on the line through theirs by the micro-batches each
    holds in flight (`held`; the first's where they hold as many); its collectives the first's,
    as stage `s` makes them (`_moved`)."""
    a, b = traced[first], traced[last]
    share = 0.0 if held[first] == held[last] else (held[s] - held[first]) / (held[last] - held[first])
    memory = {k: a.memory[k] + share * (b.memory[k] - a.memory[k]) for k in a.memory}
    peak = a.peak + share * (b.peak - a.peak)
    computed = [
        f"pp: stage {s} interpolated between stages {first} and {last} (the same children) by the micro-batches "
        f"in flight ({held[s]}; theirs {held[first]} and {held[last]})"
        if first != last
        else f"pp: stage {s} as stage {first} (the same children, as many micro-batches in flight: {held[s]})"
    ]
    return Trace(memory, peak, _moved(layout, a.ops, first, s), 0.0, computed, a.work)


def _moved(layout: Layout, ops: list[Op], first: int, s: int) -> list[Op]:
    """Stage `first`'s collectives as stage `s`, which holds the same children, makes them:
    its DDP's all-reduce (pp x dp) over stage `s`'s ranks; the others as traced (a stage is
    traced as rank 0 of its fake world: its sends go over the pipeline's group, tp's and
    FSDP2's collectives over rank 0's groups, stage 0's, whatever the stage, as in a whole
    trace)."""
    from .pipeline import stage_ranks

    own, theirs = sorted(stage_ranks(layout, first)), stage_ranks(layout, s)
    return [replace(op, ranks=theirs) if sorted(op.ranks) == own else op for op in ops]


def _traced_stage(
    spec: Spec,
    step: Step,
    layout: Layout,
    world_size: int,
    index: int,
    cuts: list[tuple[bool, int, bool]] | None = None,
) -> Trace:
    """`pipeline.trace_stage` of stage `index`; of a gpt deeper than EXTRAPOLATE_FROM blocks, a
    stage of the same place (the embedding, the head, as the split gives it them) with as many
    blocks where it holds up to TRACED_DEPTHS' larger count, else traced at TRACED_DEPTHS blocks
    and extrapolated to its own, as `_traced` extrapolates a whole model: every block adds the
    same parameters, states and activations (and, beside dp, DDP's buckets and all-reduce).
    Each trace over the step's micro-batches, or fewer (`_over_micro_batches`).
    `cuts`: `stage_cuts` of the layout's stages, where the caller has them."""
    if _depth(spec) <= EXTRAPOLATE_FROM:
        return _over_micro_batches(step, layout, world_size, index)
    embed, blocks, head = (cuts or stage_cuts(spec, layout.spec.size("pp")))[index]

    def at(n: int) -> Trace:  # the stage with n blocks (a gpt has one at least: none kept where n is 0)
        kept = ("embed",) * embed + tuple(f"block{i}" for i in range(n)) + ("head",) * head
        return _over_micro_batches(replace(step, build=spec.builder(depth=max(n, 1))), layout, world_size, index, kept)

    low, high = TRACED_DEPTHS[bool(layout.checkpointing)]
    if blocks <= high:
        traced = at(blocks)
        traced.computed.append(f"gpt: stage {index} traced with its {blocks} blocks alone")
        return traced
    return _deepened(layout, at(low), at(high), index, blocks, low, high)


def _deepened(layout: Layout, one: Trace, two: Trace, index: int, blocks: int, low: int, high: int) -> Trace:
    """Stage `index` with its `blocks` blocks, from its traces `one` and `two` at `low` and
    `high` of them: every block adds the same parameters, states and activations (and, beside
    dp, DDP's buckets and all-reduce)."""
    grows = ("parameters", "gradients", "optimizer", "activations")
    if layout.spec.size("dp") > 1 and layout.spec.size("tp") == 1:  # DDP's buckets: the stage's gradients again
        grows += ("communication",)  # (FSDP2's buffers in 3-D: the units in flight, as `_traced` has them)
    memory, peak = _extrapolated_memory(one, two, blocks - high, grows)
    ops = _extrapolated_ops(one.ops, two.ops, blocks - low)
    computed = [*two.computed, f"gpt: stage {index} traced at {low} and {high} of its {blocks} blocks, extrapolated"]
    return Trace(memory, peak, ops, 0.0, computed, _extrapolated_work(one, two, blocks - low))


def _over_micro_batches(
    step: Step, layout: Layout, world_size: int, index: int, kept: tuple[str, ...] | None = None
) -> Trace:
    """`pipeline.trace_stage` of stage `index` over the step's micro-batches; under 1f1b, of a
    step of more than twice P + 2 of them, the stage traced at P + 1 and P + 2 micro-batches and
    extrapolated to the step's.

    From P + 1 micro-batches on, each one more adds the same to a stage under torch's
    `Schedule1F1B`: the same activations and temporaries at the peak (the micro-batches in
    flight stay min(m, P - s); what grows is what the schedule keeps of every micro-batch to
    the step's end), the same sends, tp's and FSDP2's collectives, and the same operations. The
    middle and last stages settle from P on, the first only from P + 1. Checked against whole
    traces (`tests/plan/test_plan.py`): equal to the byte, collectives and counted operations
    exactly (FSDP2's collectives to a few bytes: the extrapolation gives each call of a group
    the same size), alone, beside dp and tp, in 3-D and with checkpointing. A trace costs
    about its micro-batches' passes plus one or two more (the model, the optimizer's state), so
    two traces of P + 1 and P + 2 are the cheaper beyond twice P + 2 micro-batches: a step of
    4P, the plan's choice, from P = 3 on, in a bit over half the passes at large P."""
    from .pipeline import trace_stage

    stages, chunks = layout.spec.size("pp"), max(1, step.share // layout.micro_batch)
    low = stages + 1
    if layout.schedule != "1f1b" or chunks <= 2 * (low + 1):
        return trace_stage(step, layout, world_size, index, kept)
    one, two = (
        trace_stage(replace(step, share=layout.micro_batch * m), layout, world_size, index, kept)
        for m in (low, low + 1)
    )
    n = chunks - low
    memory = {k: max(0.0, one.memory[k] + n * (two.memory[k] - one.memory[k])) for k in one.memory}
    computed = [
        *two.computed,
        f"pp: stage {index} traced at {low} and {low + 1} of the step's {chunks} micro-batches, extrapolated",
    ]
    ops, work = _extrapolated_ops(one.ops, two.ops, n), _extrapolated_work(one, two, n)
    return Trace(memory, float(sum(memory.values())), ops, 0.0, computed, work)


# Micro-batches per stage a pipeline is planned with, where the batch allows: GPipe's paper (Huang
# et al., 2019, section 2.2) finds the bubble negligible from 4 per stage on. The plan's FLOPs
# model would make fewer rows always faster (a smaller bubble), as a GPU's efficiency at small
# micro-batches, which it does not model, would not.
MICRO_BATCHES_PER_STAGE = 4


def _pipeline_micro_batches(share: int, stages: int, schedule: str = "1f1b") -> list[int]:
    """A pipeline's micro-batch sizes to try, in turn: the largest of `_micro_batches(share)`
    that gives MICRO_BATCHES_PER_STAGE per stage (else the smallest, which gives the most), then
    the smaller ones; under 1f1b never one that leaves a stage without a micro-batch. (gpipe is
    planned where none gives each stage one: the smallest, the most micro-batches.)"""
    if schedule == "gpipe":
        return _micro_batches(share)[-1:]
    sizes = [m for m in _micro_batches(share) if share // m >= stages]
    enough = [m for m in sizes if share // m >= MICRO_BATCHES_PER_STAGE * stages] or sizes[-1:]
    return [m for m in sizes if m <= enough[0]]


def _predicted(
    spec: Spec,
    cluster: Cluster,
    fitted: tuple[Layout, Trace],
    per_sample: dict[bool, float],
    children: Children = ({}, {}),
) -> Prediction:
    """A traced layout's prediction, with the FLOPs of its rank's share of the step (a
    pipeline's: its slowest stage's, from `children`)."""
    layout, traced = fitted
    share = spec.share(layout.spec.data_size)
    assert share is not None
    tp, stages = layout.spec.size("tp"), layout.spec.size("pp")
    traced.flops = per_sample[layout.checkpointing] * share / tp
    if tp > 1:
        traced.computed.append("flops: a tensor-parallel rank's share is the whole model's over tp")
    if stages > 1:
        by_stage = stage_flops(children, layout.checkpointing, stages)
        for stage, per in zip(traced.stages, by_stage):
            stage.flops = per * share / tp
        traced.flops = max(by_stage) * share / tp
        shares = ", ".join(f"{f / sum(by_stage):.0%}" for f in by_stage)
        traced.computed.append(f"flops: each stage's children's as counted (shares of the model's by stage: {shares})")
    seq = spec.in_shape[0] if spec.language else None
    model_flops = per_sample[False] * spec.global_batch
    peak = cluster.peak_flops(spec.precision, convolutions=not spec.language)
    return predict(traced, layout, cluster, peak, spec.global_batch, seq, model_flops)


# gpt deeper than this is traced at TRACED_DEPTHS blocks (by activation checkpointing, off and
# on) and extrapolated (a whole trace's time grows with the depth). Under checkpointing, from 2
# and 3 blocks the moment of the peak had not settled yet (a block's gradients took over from
# its activations at 3 to 4 blocks): 7.5% low at 10 blocks under fsdp. Measured against whole traces (2026-12-05): equal to 0.1% at 10, 12 and 16
# blocks for ddp, fsdp, fsdp+tp and tp, with checkpointing and without (width 1024 on 16 ranks,
# and width 64 on 4 in the test suite).
EXTRAPOLATE_FROM = 8
TRACED_DEPTHS = {False: (2, 3), True: (3, 4)}


def _traced(spec: Spec, step: Step, layout: Layout, world_size: int) -> Trace:
    """`trace`, of gpt at TRACED_DEPTHS blocks extrapolated to its depth where it has more:
    every block adds the same parameters, states, activations, FLOPs and collectives (the test
    suite checks the extrapolation against whole traces). Extrapolating the two peaks'
    difference instead gave negative peaks at 16 blocks under fsdp+tp with checkpointing,
    where the first trace in a process held more temporaries (see `trace._warm_up`), and
    FSDP2's buffers grow from 2 to 3 blocks but no further."""
    depth = _depth(spec)
    if depth <= EXTRAPOLATE_FROM:
        return trace(step, layout, world_size)
    low, high = TRACED_DEPTHS[bool(layout.checkpointing)]
    one, two = (trace(replace(step, build=spec.builder(depth=d)), layout, world_size) for d in (low, high))
    ops = _extrapolated_ops(one.ops, two.ops, depth - low)
    computed = [*one.computed, f"gpt: traced at {low} and {high} blocks, extrapolated to {depth}"]
    grows = ("parameters", "gradients", "optimizer", "activations")
    if layout.strategy == "ddp":  # its buckets hold every gradient; FSDP2's buffers, the units in flight
        grows += ("communication",)
    return Trace(
        *_extrapolated_memory(one, two, depth - high, grows),
        ops,
        0.0,
        computed,
        _extrapolated_work(one, two, depth - low),
    )


def _extrapolated_work(one: Trace, two: Trace, n: int) -> Any:
    """Every operation at `n` more blocks than `one`, `two` being one block deeper, where both
    counted them (`Step.count`); else None."""
    return one.work.extrapolated(two.work, n) if one.work is not None and two.work is not None else None


def _extrapolated_memory(one: Trace, two: Trace, n: int, grows: tuple[str, ...]) -> tuple[dict[str, float], float]:
    """The memory at the peak of `two` with `n` more blocks: each role in `grows` grows by its
    growth from `one` to `two` per block, never less than none; temporaries, and FSDP2's
    communication buffers (the units in flight: a fixed number), do not grow with the depth.
    The peak is the larger of the two traces' plus that growth."""
    growth = {k: max(0.0, two.memory[k] - one.memory[k]) for k in grows}
    peak = max(one.peak, two.peak) + n * sum(growth.values())
    memory = {k: two.memory[k] + n * growth.get(k, 0.0) for k in two.memory}
    memory["temporary"] = peak - sum(v for k, v in memory.items() if k != "temporary")
    return memory, peak


def _extrapolated_ops(one: list[Op], two: list[Op], n: int) -> list[Op]:
    """The collectives at `n` more blocks than `one`'s: per kind and group, the calls and the
    bytes grow by `two`'s excess over `one` for each block (a whole-model collective, DDP's
    all-reduce, grows in bytes; a per-block one in calls), as one `Op` of that many calls of
    equal size."""
    out = []
    for key in dict.fromkeys((op.kind, op.ranks) for op in [*one, *two]):
        c1, c2 = (sum(op.calls for op in ops if (op.kind, op.ranks) == key) for ops in (one, two))
        b1, b2 = (sum(op.bytes * op.calls for op in ops if (op.kind, op.ranks) == key) for ops in (one, two))
        calls, size = c1 + n * (c2 - c1), b1 + n * (b2 - b1)
        out += [Op(key[0], size // calls, key[1], calls)] if calls > 0 else []
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
        parts += [f"--data {spec.data or 'text'}", f"--seq-len {spec.in_shape[0]}"]
        parts += [
            f"--gpt-{name.replace('_', '-')} {value}" for name, value in spec.options.items() if value is not None
        ]
    elif spec.data and spec.data != "synthetic":
        parts += [f"--data {spec.data}"]
    else:  # the shape planned, as synthetic images
        shape = ",".join(str(n) for n in spec.in_shape)
        parts += ["--data synthetic", f"--synthetic-shape {shape}", f"--num-classes {spec.num_classes}"]
    parts += [f"--device {cluster.gpu.device}", f"--nproc {cluster.gpus_per_node}"]
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
    if layout.schedule == "gpipe":
        parts += ["--pp-schedule gpipe"]
    if layout.checkpointing:
        parts += ["--activation-checkpointing true"]
    if layout.checkpointing_mode == "selective":
        parts += ["--activation-checkpointing-mode selective"]
    return " ".join(parts)
