"""Pipeline layouts (`--mesh pp=P`; `pp=P,dp=D`: D pipelines, each stage under DDP over dp;
`pp=P,tp=T`: each stage's layers split over T ranks; `pp=P,dp=D,tp=T`: 3-D), traced stage by
stage on fake tensors:
what each stage's rank holds at its peak under torch's own 1f1b schedule (ddpkit's default;
gpipe where a step has fewer micro-batches than stages) over a step's micro-batches.

Each stage is traced on its own, as rank 0 of a fake world: the model built on meta, cut by
`strategy.pp.split` (the stages a run has), given fake storage, and run by torch's
`PipelineStage` and `Schedule1F1B` (or `ScheduleGPipe`), whose sends and receives the fake process group takes
without values. So the activations the schedule keeps in flight (up to P - s micro-batches on
stage s), the stage's parameters, gradients and
optimizer state and the losses are torch's own, counted by `MemTracker`. Four things the fake
group cannot give are given instead:

- the shapes a stage receives and sends (`input_args`, `output_args`), from one forward of the
  whole model on fake tensors, where a run's first step sends them; a stage's input and output
  given as needing gradients, as the activations a run's stages exchange do (given without,
  torch's stage held one tensor of the input fewer per micro-batch, and a real run so given
  computed wrong gradients);
- the schedule's first vote between the stages (whether the shapes are static), whose answer
  arrives as a value: set to static, as given;
- the buffers a stage receives into (one per micro-batch, made by the first step and kept)
  are made before the tracked step (`ready`), as in the real run it is checked against, and so
  are out of the tracker's sight in both;
- on gloo, what its send works hold: each tensor sent, for as long as the schedule keeps the
  send's work (`gloo_sends`).

With dp beside pp, the traced rank runs data rank 0's pipeline (its stages' ranks, a group of
their own) on its share of the batch, and the stage's DDP is counted as a plan counts DDP's
(`trace.ddp_counted`): its gradient buckets, one more copy of the stage's gradients, and one
all-reduce of them over the stage's data ranks per step.

With tp beside pp, the traced rank is its stage's tp rank 0: the stage's children are built
again on meta, their layers split over tp by `strategy.pp.split_layers` (the model's plan, as
a run splits them), and given fake storage; tp's collectives within the stage are the fake
group's, counted. The stages send whole activations (the plan's layers hand on replicated
outputs). In 3-D (pp x dp x tp) the stage is sharded over dp by `strategy.pp.shard_stage`, as a
run shards it, and traced under FSDP2's own tracker (`FSDPMemTracker`, as `verify` measures
such a stage), with gloo's reduce-scatter copy where the run is on gloo (`trace.GlooCopies`).

`ddpkit plan` traces its pp layouts' stages (`run._stage_traces`: two of each set of stages
alike, the ones between interpolated; from 8 stages on, each set posed where few micro-batches
are in flight, `run._posed_stages`);
`tests/plan/test_real_runs.py` checks each stage's peak against a real run's
(`verify.measured_ranks`) on 2, 4 and 8 processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..core.precision import AutocastModule, Precision
from ..observe.collectives import Collectives
from .trace import (
    Counting,
    GlooCopies,
    Layout,
    Step,
    Trace,
    _make_state,
    built,
    checkpointing_apply,
    ddp_counted,
    loss,
    memory_tracker,
    optimizer,
    roles,
)

# Imports inside functions: torch's fake tensors, pipelining and memory tracker load when a
# trace runs.


def trace_stage(
    step: Step,
    layout: Layout,
    world_size: int,
    index: int,
    kept: tuple[str, ...] | None = None,
    posed: int | None = None,
) -> Trace:
    """Stage `index`'s step of `layout` (a mesh of pp, with dp, tp, both or neither), in a process of
    `trace.in_fake_worlds`: see the module docstring. The stage holds the children of the
    step's model that `strategy.pp.split` gives it, or those named in `kept` (a stage of a
    deeper model, with fewer blocks: `run._traced_stage`; a stage posed in another place:
    `run._posed_stages`). `posed`: the first stage run as the first of a pipeline of that many
    stages (the first ranks of the layout's pipeline), which holds as many micro-batches in
    flight."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ..strategy.pp import keep_children, split

    spec = layout.spec
    spec.check_processes(world_size)
    tp = spec.size("tp")
    if "pp" not in spec.names or set(spec.names) - {"pp", "dp", "tp"}:
        raise ValueError(f"trace_stage: a mesh of pp with dp and tp or not, not {layout.mesh}")
    count, rows = spec.size("pp"), layout.micro_batch
    chunks = max(1, step.share // rows)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, on_meta = built(step.build, mode)
    if layout.checkpointing:
        checkpointing_apply(model, layout.checkpointing)
    names = list(model._modules)
    with mode:
        if on_meta:
            model.to_empty(device="cpu")
        x, _ = step.batch(rows)
        with torch.no_grad():  # what each child hands on: the shapes the stages send
            sent, h = {}, x
            for name, child in model.named_children():
                h = sent[name] = child(h)
        if kept is None:
            kept = split(model, index, count).kept
        else:
            keep_children(model, kept)
    if tp > 1:  # pp x tp: the stage's layers split over tp as a run splits them (on meta, `trace.built`)
        model = _split_stage(step, layout, kept, mode)
    with mode:
        first = names.index(kept[0])
        given, out = (x if first == 0 else sent[names[first - 1]]), sent[kept[-1]]
        assert posed is None or index == 0, "only the first stage is posed in a shorter pipeline"
        stages = posed or count  # (the layout's own: its stages' children, as `split` cuts them)
        last = index == stages - 1
        run = (
            model if step.precision == "fp32" else AutocastModule(model, Precision(step.precision, torch.device("cpu")))
        )
        pipe = PipelineStage(
            run,
            index,
            stages,
            torch.device("cpu"),
            input_args=(_like(given, index > 0),),
            output_args=(_like(out, True),),
            group=_pipeline_group(layout, posed),
        )
        schedule = ScheduleGPipe if layout.schedule == "gpipe" else Schedule1F1B
        steps = schedule(pipe, max(chunks, stages), loss_fn=loss, scale_grads=False)
        if chunks < stages:
            # A posed stage (`run._posed_stages`) runs fewer micro-batches than its pipeline has
            # stages, which torch refuses as it makes the schedule (a run cannot), not as it runs
            # it: stage s warms up with min(m, P - s), here fewer than m. (Its order, not read
            # by a single stage's schedule as it runs, is made again for those micro-batches.)
            steps._n_microbatches = chunks
            steps.pipeline_order = steps._get_pipeline_order()
        steps._warmup_p2p = _static  # type: ignore[method-assign]
        opt = optimizer(step.optimizer, model, step.foreach)
        _make_state(model, opt)

        def one_step(n: int) -> None:
            xs, ys = step.batch(rows * n)  # the step's batch, made in it (a run's loader reads it then)
            steps.step(*((xs,) if index == 0 else ()), target=ys if last else None, return_outputs=False)
            opt.step()
            opt.zero_grad(set_to_none=True)

        ready(steps, one_step, step.batch(rows), index == 0, last, tp)
        # once per micro-batch; under pp x dp x tp FSDP2's tracker, as a run's stage is measured (verify)
        tracker = memory_tracker(model, opt, per_call=True)
        copies = GlooCopies() if step.backend == "gloo" else contextlib.nullcontext()
        sends = gloo_sends() if step.backend == "gloo" else contextlib.nullcontext()
        counting = Counting() if step.count else contextlib.nullcontext()  # (outside the copies: see `trace._step`)
        with tracker, copies, sends, Collectives() as collectives, counting:
            one_step(chunks)
    memory, ops, computed = roles(tracker), list(collectives.ops), [f"pp: stage {index} of {count}"]
    work = counting.ops if isinstance(counting, Counting) else None
    if spec.size("dp") > 1 and tp == 1:  # pp x dp: the stage's DDP (the model holds the stage's children alone)
        ddp_counted(memory, ops, model, stage_ranks(layout, index), work)
        computed.append("pp x dp: the stage's DDP over dp: its gradient buckets (one more copy) and one all-reduce")
    if tp > 1:
        computed.append(f"pp x tp: the stage's layers split over tp={tp} by the model's tensor-parallel plan")
    return Trace(memory, float(sum(memory.values())), ops, 0.0, computed, work)


def ready(
    steps: Any, one_step: Callable[[int], None], batch: tuple[Any, Any], first: bool, last: bool, tp: int
) -> None:
    """The stage ready for its tracked step: the buffers it receives into, one per micro-batch,
    made as a run's first step makes them and keeps them (`_initialize_stage`, what torch's
    schedule runs at the start of its first step, from a micro-batch: `batch`, its input read
    by the first stage and its labels by the last). Under tp a step of two micro-batches runs
    then (`one_step(2)`, torch's schedule told of two for it, as a posed stage is told of
    fewer): DTensor works out each operation's sharding the first time it meets it, on fake
    tensors that would otherwise count as the tracked step's temporaries (`trace._warm_up`).
    Every micro-batch of a step has the same shapes, and the second adds its gradients to the
    first's: with one micro-batch alone, the first stage of pp 2 x tp 2 (fp32) peaked 5.7%
    high, the accumulation's operations met first in the tracked step.

    Nothing else of that first step outlasts it: the optimizer's state is made before
    (`trace._make_state`), and its gradients are let go. Every figure of a trace was the same
    to the byte, its collectives and counted operations too, made ready so as after a run's
    whole first step: without tp, 23 stages on 2026-12-07 (pp 2, 3 and 4 stages, each one;
    pp 2 x dp 2; 1f1b and gpipe; fp32 and bf16; with checkpointing; a first stage posed in a
    shorter pipeline; fewer micro-batches than stages), and a trace took less CPU (a 6-block gpt
    of width 1024 over 1,024 tokens, pp 2 x dp 4, 8 micro-batches: 3.7 s for its first stage
    against 4.6, 4.2 against 5.0 for its last); with tp, 6 stages (pp 2 x tp 2, both; pp 3 x
    tp 2 with checkpointing; 3-D, both, with checkpointing and without; gpipe), each the first
    trace in its process. `tests/plan/test_plan.py` checks it."""
    x, y = batch
    steps._initialize_stage((x,) if first else (), {}, y if last else None)
    if tp > 1:
        chunks = steps._n_microbatches
        steps._n_microbatches = min(2, chunks)
        steps.pipeline_order = steps._get_pipeline_order()
        one_step(steps._n_microbatches)
        steps._n_microbatches = chunks
        steps.pipeline_order = steps._get_pipeline_order()


@contextlib.contextmanager
def gloo_sends() -> Iterator[None]:
    """A gloo run's sends between the stages, on the fake process group's: gloo's send work
    holds the tensor it sends until the work itself is let go (`ProcessGroupGloo`'s
    `AsyncSendWork`), and torch's schedules keep some works to the step's end. 1f1b keeps the
    sends of its warm-up's last fired forward (`send_work`: that micro-batch's output, after
    its backward has let its own copy go), gpipe every forward's (its stage 0 of pp 2 over four
    micro-batches of 2 stayed at 0.969 of the real peak, which comes as its forwards end, every
    output held anyway). The fake group's works hold
    nothing. Here each send's work is handed back with its tensor held beside it, for as long
    as the schedule keeps the work. Measured: stage 0 of pp 2 (fp32, four micro-batches of 2)
    held 32,768 bytes of activations more in the real run than in its trace, one micro-batch's
    output; with its sends held, the trace holds them too (0.972 of the real peak, then 0.984),
    and stage 2 of pp 4 (bf16) went from 0.981 to 0.998. NCCL's works are not modelled."""
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def held(ops: list[Any], desc: str | None = None) -> list[Any]:
        works = batch(ops, desc)
        if len(works) != len(ops):  # (coalesced: one work for them all, waited at once by the schedule)
            return works
        return [_Held(w, op.tensor) if op.op is dist.isend else w for w, op in zip(works, ops)]

    schedules._batch_p2p = held
    try:
        yield
    finally:
        schedules._batch_p2p = batch


class _Held:
    """A send's work, and the tensor its gloo work would hold (`gloo_sends`)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: Any) -> Any:
        return self.work.wait(*args)


def _split_stage(step: Step, layout: Layout, kept: tuple[str, ...], mode: Any) -> torch.nn.Module:
    """pp x tp: the stage's children (`kept`) of the step's model, built on meta, their layers
    split over the traced rank's tp ranks by `strategy.pp.split_layers` (the model's plan), then
    given fake storage: what a run's stage holds under tp (its DTensor parameters)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..strategy.pp import keep_children, shard_stage, split_layers

    model, on_meta = built(step.build, mode)
    if layout.checkpointing:
        checkpointing_apply(model, layout.checkpointing)
    keep_children(model, kept)
    shape, names = layout.spec.grid()  # (outside fake mode: DeviceMesh computes coordinates from real tensors)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    split_layers(model, kept, mesh["tp"])
    if layout.spec.size("dp") > 1:  # pp x dp x tp: the stage sharded over dp by FSDP2, as a run shards it
        shard_stage(model, mesh["dp"])
    if on_meta:
        with mode:
            model.to_empty(device="cpu")
    return model


def stage_ranks(layout: Layout, index: int) -> tuple[int, ...]:
    """The global ranks that run stage `index` of `layout`'s pipelines: one per data rank."""
    spec = layout.spec
    return tuple(r for r in range(spec.processes) if spec.coordinates(r).get("pp", 0) == index)


def _pipeline_group(layout: Layout, posed: int | None = None) -> Any:
    """The process group of the traced rank's pipeline (data rank 0's stages, of tp rank 0);
    None, the whole world, where the mesh is pp alone. `posed`: its first ranks alone, as many."""
    if layout.spec.processes == layout.spec.size("pp") and posed is None:
        return None
    return dist.new_group(list(pipeline_ranks(layout)[:posed]))


def pipeline_ranks(layout: Layout) -> tuple[int, ...]:
    """The global ranks of the traced rank's pipeline (data rank 0's stages, of tp rank 0)."""
    return tuple(stage_ranks(layout, s)[0] for s in range(layout.spec.size("pp")))


def _like(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """An empty tensor of `t`'s shape and dtype; needing gradients where `grad` (and it can)."""
    empty = torch.empty(t.shape, dtype=t.dtype)
    return empty.requires_grad_() if grad and empty.is_floating_point() else empty


def _static(stages: Any, has_backward: bool, p2p_done: bool) -> None:
    """The schedule's first vote between the stages, answered: the shapes are static (given)."""
    from torch.distributed.pipelining.stage import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC
