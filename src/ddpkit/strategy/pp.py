"""`pp`: pipeline parallel over the mesh's `pp` dimension (`--mesh pp=2`), with torch's
`torch.distributed.pipelining` (`PipelineStage`, `ScheduleGPipe`, `Schedule1F1B`).

The model is an `nn.Sequential` (ddpkit's gpt and image models are): each rank keeps a
contiguous run of its children, chosen so that the stages hold about as many parameters each,
and drops the others. The children it keeps keep their names (`block2.attn.q.weight` stays
that), so a stage's state_dict is its share of the whole model's, and a checkpoint written under
pp loads under any other layout and the other way round.

A training step goes through the schedule, not through `model(x)` and `rt.backward`: the loop
hands `rt.forward_backward` each micro-batch of the step; on the last one, the schedule runs
them all, forward and backward, as the pipeline's micro-batches (each padded to the same
number of rows; the loss function sees the real rows only). The loss of each micro-batch is weighted by its
share of the global batch's samples or tokens, the schedule does not rescale (`scale_grads=False`),
so the gradients are the global batch's mean, as on one process. Dropout draws per micro-batch
as the loader laid it out: the same masks as on any other layout.

Evaluation runs each batch through a forward-only schedule, and the last stage's output is
broadcast to the other stages: every rank's `model(x)` then returns the whole output, and exact
evaluation, metrics and gathered outputs work as under any strategy. (The broadcast costs one
copy of the output per evaluation batch; the loss alone would be cheaper, not done yet.)

The pipeline's ranks read the same samples: `pp` is not a data dimension (see ddpkit.strategy.mesh).
With `dp` beside it (`pp=2,dp=2`), each data rank runs a pipeline of its own, and each stage is
replicated over `dp` under DDP, which torch's `PipelineStage` keeps from all-reducing until the
step's last micro-batch. With `tp` beside it (`pp=2,tp=2`), each stage's layers are split over
`tp` by the model's plan, as under tp (its DTensors made whole for model.pt); the `tp` ranks of a
stage read the same samples. With both (`pp=2,dp=2,tp=2`, 3-D), each stage is also sharded over
`dp` by FSDP2, as tp shards a whole model, and every data rank runs every forward.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..core import dist
from ..errors import UsageError
from .base import Strategy, local, unwrap
from .ddp import DDPOptions, comm_hook
from .fsdp import any_dtensor
from .mesh import MeshSpec

# Imports inside functions: torch's pipelining modules load where a pipeline runs, not in every
# run (ddp too imports the strategies).

SCHEDULES = ("1f1b", "gpipe")
DEFAULT_SCHEDULE = "1f1b"


@dataclass
class Stage:
    """What a pipelined model knows of its place: which stage it is, of how many, the names of
    the children it kept and the whole model's parameter shapes; and its pipeline."""

    index: int
    count: int
    kept: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    names: dict[int, str] = field(default_factory=dict)  # id of each whole-model parameter -> its name (until adopt)
    pipeline: Pipeline | None = None
    # id of an optimizer -> its parameter groups as the whole model's parameter names, as built
    # (what a whole optimizer state's indices refer to: see load_full_optimizer_state)
    optimizer_groups: dict[int, list[list[str]]] = field(default_factory=dict)

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def stage_of(model: nn.Module) -> Stage | None:
    """The `Stage` of a model `pp` split (through any wrapper), else None."""
    return getattr(unwrap(model), "_ddpkit_stage", None)


class PipelineParallel(Strategy):
    """Stages of an nn.Sequential over `pp`, run by torch's schedules (see the module docstring)."""

    name = "pp"
    mesh_dims: ClassVar[tuple[str, ...]] = ("pp", "dp", "tp")
    own_dim: ClassVar[str | None] = "pp"
    takes_tp_plan: ClassVar[bool] = True  # pp x tp: each stage's layers split by it
    lockstep: ClassVar[bool] = True
    sharded: ClassVar[bool] = True
    keeps_ranks_in_step: ClassVar[bool] = True
    sync_batchnorm: ClassVar[bool] = False
    refuses_sync_batchnorm: ClassVar[str] = "--strategy pp does not support SyncBatchNorm (--sync-batchnorm)"
    pipelined: ClassVar[bool] = True
    tunable: ClassVar[bool] = True

    def __init__(self, device: torch.device, schedule: str = DEFAULT_SCHEDULE, ddp: Any = None):
        super().__init__(device)
        self.schedule = schedule
        self.ddp = DDPOptions() if ddp is None else ddp  # over dp (pp x dp): each stage's DDP
        self._kept: dict[str, nn.Parameter] = {}  # the parameters this stage kept, by name (adopt)
        self._stage: Stage | None = None

    @classmethod
    def make(cls, device: torch.device, ddp: Any, fsdp: Any) -> Strategy:
        return cls(device, ddp=ddp)

    @classmethod
    def default_mesh(cls, world_size: int, local_world_size: int) -> MeshSpec:
        return MeshSpec((("pp", world_size),))

    @classmethod
    def needs_device_mesh(cls, spec: MeshSpec) -> bool:
        return True

    @classmethod
    def owns(cls, model: nn.Module) -> bool:
        return stage_of(model) is not None

    @classmethod
    def bytes_per_weight(cls, world_size: int) -> float:
        return 16.0  # a stage's share, but every rank builds the whole model first

    @classmethod
    def full_model_state(cls, model: nn.Module) -> dict[str, Any]:
        """Every stage's state_dict (under pp x tp each tensor made whole over tp first),
        gathered (in CPU memory) and merged on rank 0."""
        own = {k: whole(v).detach().cpu() for k, v in unwrap(model).state_dict().items()}
        parts = dist.gather_objects(own)
        if dist.rank() != 0:
            return {}
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    @classmethod
    def load_full_model_state(cls, model: nn.Module, state: dict[str, Any]) -> None:
        bare = unwrap(model)
        own = bare.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"the state has no {', '.join(missing[:3])}")
        bare.load_state_dict({k: shaped_as(own[k], state[k]) for k in own})

    @classmethod
    def load_full_optimizer_state(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """An `Optimizer.state_dict()` of an optimizer built on the whole model (one process,
        ddp): this stage's parameters' share of it, matched by name."""
        stage = stage_of(model)
        assert stage is not None
        if any_dtensor(unwrap(model).parameters()):
            raise UsageError(
                "under pp x tp, an optimizer state saved on one process or under ddp does not load yet; resume from "
                "a sharded checkpoint (any layout's but those), which DCP splits over tp"
            )
        whole = stage.optimizer_groups.get(id(optimizer))
        if whole is None:
            raise UsageError(
                "under pp, a whole optimizer state loads into an optimizer given to setup() (built on the whole "
                "model): its parameters' names are known from there"
            )
        saved = state["param_groups"]
        if len(saved) != len(whole) or any(len(s["params"]) != len(w) for s, w in zip(saved, whole)):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
            )
        name_of = {i: name for s, w in zip(saved, whole) for i, name in zip(s["params"], w)}
        own = dict(unwrap(model).named_parameters())
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        groups = [
            {**{k: v for k, v in s.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for s, g in zip(saved, optimizer.param_groups)
        ]
        kept = {index[id(own[name_of[i]])]: v for i, v in state["state"].items() if name_of.get(i) in own}
        optimizer.load_state_dict({"state": kept, "param_groups": groups})

    def wrap(
        self, model: nn.Module, precision: Any = None, channels_last: bool = False, compile: Any = False
    ) -> nn.Module:
        refuse_options("--strategy pp", precision.name if precision is not None else "fp32", compile)
        assert self.layout is not None
        self._stage = split(model, self._pp_index(), self._pp_size())
        if self.layout.spec.size("tp") > 1:  # before the optimizers are adopted: DTensor parameters
            self._split_layers(model)
        return super().wrap(model, precision, channels_last, compile)

    def _split_layers(self, model: nn.Module) -> None:
        """pp x tp: the stage's layers split over tp (`split_layers`)."""
        assert self.layout is not None and self._stage is not None
        split_layers(model, self._stage.kept, self.layout.sub("tp"), self.tp_plan)

    def _wrap(self, model: nn.Module) -> nn.Module:
        stage = stage_of(model)
        assert stage is not None and self.layout is not None
        replicas, shards = None, self.layout.spec.size("dp") > 1 and self.layout.spec.size("tp") > 1
        if shards:  # pp x dp x tp: the stage sharded over dp (FSDP2), as tp shards a whole model
            self._shard(unwrap(model))
        elif self.layout.spec.size("dp") > 1:  # each stage replicated over dp: DDP, run by torch's stage
            from torch.nn.parallel import DistributedDataParallel

            # No buffer broadcast: a forward in evaluation (an empty batch skipped on one data
            # rank) must not wait for the others; the stage has no running statistics (BatchNorm
            # is refused) and every replica built the same buffers. find_unused_parameters, and
            # no static graph: DDP then never rebuilds its buckets, which under torch's schedules
            # (2.13) records the parameters of two backward passes and fails its own assertion at
            # the next forward, for most micro-batch counts of either schedule. (A static graph
            # runs without that error, but its gradients came out wrong: 0.25 from one process.)
            options = dataclasses.replace(
                self.ddp, broadcast_buffers=False, find_unused_parameters=True, static_graph=False
            )
            ids = [self.device.index] if self.device.type == "cuda" else None
            group = self.layout.sub("dp").get_group()
            replicas = DistributedDataParallel(model, device_ids=ids, process_group=group, **options.kwargs())
            hook = comm_hook(options.comm_hook)
            if hook is not None:  # (its state: the group it all-reduces over; None would be every rank)
                replicas.register_comm_hook(state=group, hook=hook)
        group = self.layout.sub("pp").get_group()
        stage.pipeline = Pipeline(model, stage, group, self.device, self.schedule, replicas, lockstep=shards)
        self._kept = dict(unwrap(model).named_parameters())  # (fully_shard and tp replace them: by name)
        return model

    def _shard(self, stage: nn.Module) -> None:
        """pp x dp x tp: the stage sharded over dp (`shard_stage`)."""
        assert self.layout is not None
        shard_stage(stage, self.layout.sub("dp"))

    def _pp_index(self) -> int:
        assert self.layout is not None
        return self.layout.spec.coordinates(dist.rank()).get("pp", 0)

    def _pp_size(self) -> int:
        assert self.layout is not None
        return self.layout.spec.size("pp")

    def adopt(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        """An optimizer built on the whole model steps this stage's parameters only."""
        stage = self._stage
        assert stage is not None
        for opt in optimizers:
            if opt.state:
                raise UsageError("under pp, pass setup() an optimizer that has not stepped yet")
            stage.optimizer_groups[id(opt)] = [
                [stage.names.get(id(p), "") for p in g["params"]] for g in opt.param_groups
            ]
            for group in opt.param_groups:  # (under pp x tp the kept ones are DTensors now: by name)
                names = (stage.names.get(id(p)) for p in group["params"])
                group["params"] = [self._kept[n] for n in names if n in self._kept]
        stage.names = {}  # (the dropped parameters may go: their ids with them)

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The norm over every stage's gradients: each stage's sum of squares (under pp x tp
        over its tp shards too), added up over the pipeline; then torch's formula's scaling,
        each rank its own parts."""
        from .tp import total_norm

        assert self.layout is not None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        own = total_norm(grads).to(self.device) if grads else torch.zeros((), device=self.device)
        squares = dist.all_reduce(own.double().reshape(1) ** 2, group=self.layout.sub("pp").get_group())
        norm = squares.sqrt().reshape(()).float()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_([local(g) for g in grads], coefficient.to(local(grads[0]).device))
        return norm


def split_layers(model: nn.Module, kept: tuple[str, ...], mesh: Any, given: Any = None) -> None:
    """pp x tp: a stage's layers (its `kept` children's) split over the tp `mesh` by the model's
    plan (or the Runtime's, `given`), the entries for other stages' children left out."""
    from .tp import parallelize, plan_for

    plan = plan_for(model, given, mesh.size())
    if isinstance(plan, dict):
        plan = {k: v for k, v in plan.items() if fnmatch.filter(kept, k.split(".")[0])}
        if not plan:  # no planned layer on this stage: it runs whole on each of its tp ranks
            return
    parallelize(model, mesh, plan)


def shard_stage(stage: nn.Module, mesh: Any) -> None:
    """pp x dp x tp: FSDP2 over the dp `mesh` on a stage (each child a unit, then the stage):
    every rank built the same model, so each keeps its own shards, with no broadcast."""
    from torch.distributed.fsdp import fully_shard

    for child in stage.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(stage, mesh=mesh)


def keep_children(model: nn.Module, kept: Sequence[str]) -> None:
    """`model` with the children named in `kept` alone (a stage's)."""
    for name in list(model._modules):
        if name not in kept:
            del model._modules[name]  # (not `del model[i]`: that renumbers the children)


def split(model: nn.Module, index: int, count: int) -> Stage:
    """Keep stage `index` of `count` of the Sequential `model` in place (its children's names
    unchanged), the stages cut where each holds about as many parameters. UsageError for a
    model that cannot be split so."""
    if not isinstance(model, nn.Sequential):
        raise UsageError(
            f"--strategy pp splits an nn.Sequential model between its children (ddpkit's gpt and image models "
            f"are one); {type(model).__name__} is not"
        )
    norm = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if norm is not None:
        raise UsageError(
            f"--strategy pp: the model's {norm[0]} is a {type(norm[1]).__name__}, whose batch statistics would count "
            "the rows a pipeline pads its micro-batches with; use --strategy ddp or fsdp for it (or a model with "
            "LayerNorm or GroupNorm)"
        )
    names = list(model._modules)
    if len(names) < count:
        raise UsageError(f"--mesh pp={count}: the model has {len(names)} children to split into {count} stages")
    sizes = [sum(p.numel() for p in model._modules[n].parameters()) for n in names]  # type: ignore[union-attr]
    bounds = balanced_cuts(sizes, count)
    owner: dict[int, int] = {}  # id of a parameter -> the stage holding it
    for s in range(count):
        for name in names[bounds[s] : bounds[s + 1]]:
            for p in model._modules[name].parameters():  # type: ignore[union-attr]
                if owner.setdefault(id(p), s) != s:
                    raise UsageError(
                        f"--strategy pp: {name} shares a parameter with a child on another stage (tied weights); "
                        "a pipeline cannot split it there"
                    )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    param_names = {id(p): name for name, p in model.named_parameters()}
    kept = tuple(names[bounds[index] : bounds[index + 1]])
    keep_children(model, kept)
    stage = Stage(index, count, kept, shapes, param_names)
    model._ddpkit_stage = stage  # type: ignore[assignment]
    return stage


def refuse_options(where: str, precision: str, compile: Any) -> None:
    """UsageError for what a pipeline does not run: fp16 and torch.compile (`where`: the flag or
    mesh to name)."""
    if precision == "fp16":
        raise UsageError(f"{where}: fp16's loss scaling does not run through a pipeline schedule; use bf16")
    if compile:
        raise UsageError(f"{where}: --compile under a pipeline is not supported yet")


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t`, made whole where it is a DTensor split over tp (a collective over its mesh)."""
    return t.full_tensor() if any_dtensor((t,)) else t  # type: ignore[attr-defined]


def shaped_as(own: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A whole `value` for the entry `own` of a state_dict: where `own` is a DTensor, this
    rank's part of it (every rank holds the whole value: no message)."""
    if not any_dtensor((own,)):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(own.device), own.device_mesh, own.placements, src_data_rank=None)  # type: ignore[attr-defined]


def micro_batch_size(share: int, stages: int) -> int:
    """The micro-batch size that cuts a data rank's `share` of a step into as many micro-batches
    as there are `stages`, or a few more where equal pieces cannot make that many (6 over 4
    stages: 1, as 2 would make 3): the largest up to share/stages, rounded up, that gives 1f1b at
    least one per stage."""
    size = -(-share // stages)
    while size > 1 and -(-share // size) < stages:
        size -= 1
    return size


def split_stages(model: nn.Module, count: int) -> None:
    """The UsageError `split` would raise for `model` on `count` stages, if any (checked on a
    copy built on the meta device: it is cut)."""
    split(model, 0, count)


def balanced_cuts(sizes: Sequence[int], parts: int) -> list[int]:
    """Cut points [0, ..., len(sizes)] of `parts` contiguous non-empty runs whose largest sum is
    the least it can be (the first such cut, scanning from the left)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: the least largest run covering sizes[:i] with k runs; cut[k][i]: where the last began
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


@dataclass
class Pipeline:
    """One stage's schedules: the training one (made at the first step, when the number of
    micro-batches is known) and a forward-only one per shape of evaluation batch."""

    module: nn.Module  # the stage as the strategy wrapped it (what setup() returned)
    stage: Stage
    group: Any
    device: torch.device
    schedule: str
    replicas: nn.Module | None = None  # pp x dp: the stage under DDP over dp (what the schedules call then)
    lockstep: bool = False  # sharded over dp (pp x dp x tp): every data rank runs every forward
    _train: Any = None
    _train_shape: tuple[int, int] | None = None  # (micro-batches, rows each)
    _evals: dict[Any, Any] = field(default_factory=dict)  # input (shape, dtype) -> its schedule
    _outputs: dict[Any, Any] = field(default_factory=dict)  # input (shape, dtype) -> the output's
    _queue: list[tuple[Any, Any, Any]] = field(default_factory=list)  # the step's (x, y, MicroBatch)
    _micros: list[Any] = field(default_factory=list)  # each chunk's MicroBatch, during a step

    def __post_init__(self) -> None:
        self.on_chunk: Callable[[Any], None] | None = None  # told each chunk's MicroBatch (dropout's keys)
        self._loss: Callable[[Any, Any], torch.Tensor] | None = None  # the step's weighted loss
        self._running = False  # a schedule is calling the module
        self._index: int | None = None  # the micro-batch the schedule runs now
        self._buffers: list[torch.Tensor] | None = None  # the module's, before a new schedule's first step
        self.module.register_forward_pre_hook(self._guard)

    def _guard(self, module: nn.Module, args: Any) -> None:
        if not self._running:
            raise UsageError(
                "under pp a stage's forward runs inside the pipeline's schedule: train with "
                "rt.forward_backward(model, x, y, loss_fn), evaluate with rt.evaluate (or ddpkit's evaluation)"
            )

    @property
    def last_rank(self) -> int:
        """The global rank of the last stage (of this rank's pipeline)."""
        return torch.distributed.get_global_rank(self.group, self.stage.count - 1)

    def chunk(self, index: int) -> None:
        """The schedule is about to run micro-batch `index` forward or backward (a backward may
        recompute the forward: activation checkpointing)."""
        self._index = index
        if self._buffers is not None:  # the first, after torch's look at the shapes
            with torch.no_grad():
                for buffer, kept in zip(self.module.buffers(), self._buffers):
                    buffer.copy_(kept)
            self._buffers = None
        if self._micros and self.on_chunk is not None:
            self.on_chunk(self._micros[index])

    def _keep_buffers(self) -> None:
        """Before a new schedule's first step: torch's PipelineStage works out the shapes it sends
        by running the stage once (on the first micro-batch, or on uninitialized tensors past the
        first stage), which a module with running statistics would count; `chunk` puts them back."""
        self._buffers = [b.detach().clone() for b in self.module.buffers()]

    # -- training ------------------------------------------------------------------------------
    def add(self, x: torch.Tensor, y: torch.Tensor, micro: Any) -> None:
        self._queue.append((x, y, micro))

    @property
    def queued(self) -> list[Any]:
        """The MicroBatch of each micro-batch held for the step."""
        return [micro for _, _, micro in self._queue]

    def run(
        self,
        chunks: int,
        rows: int,
        weights: list[float],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        measure: Callable[[Any, Any], tuple[Any, ...]] | None,
    ) -> list[tuple[Any, ...]]:
        """The queued micro-batches of a step, forward and backward through the schedule, as
        `chunks` micro-batches of `rows` rows (padded; `loss_fn` sees the real rows only);
        `weights`: what each queued one's mean loss counts. Returns, on the last stage, (loss, *measure) of each
        queued micro-batch that holds samples ([] on the others)."""
        queue, self._queue = self._queue, []
        if len(queue) > chunks:
            raise UsageError(f"--strategy pp: a step of {len(queue)} micro-batches, more than the {chunks} planned")
        xs, ys, micros = padded(queue, chunks, rows)
        schedule = self._training(chunks, rows)
        results: list[tuple[Any, ...]] = []
        weights = weights + [0.0] * (chunks - len(weights))

        def weighted(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            i = self._index  # the micro-batch whose forward just ran
            if i is None:  # torch's first look at the shapes (its metadata inference): no micro-batch
                return loss_fn(out, y)
            n = len(queue[i][0]) if i < len(queue) else 0  # its samples; the rest is padding
            if n == 0:  # no sample: nothing to learn, but the schedule's backward still runs
                return out.sum() * 0.0
            out, y = out[:n], y[:n]  # the loss never sees the padding, whatever it computes
            loss = loss_fn(out, y)
            if queue[i][2].count:
                results.append((loss.detach(), *(measure(out.detach(), y) if measure else ())))
            w = weights[i]
            return loss * w if w > 0 else loss.nan_to_num(0.0) * 0.0

        self._loss, self._micros, self._index = weighted, micros, None  # (the loss: once per micro-batch, in order)
        self._running = True
        try:
            first = self.stage.index == 0
            schedule.step(
                *((torch.cat(xs),) if first else ()),
                target=torch.cat(ys) if self.stage.is_last else None,
                return_outputs=False,
            )
        finally:
            self._loss, self._micros, self._running = None, [], False
        return results

    def _training(self, chunks: int, rows: int) -> Any:
        """The schedule of steps of `chunks` micro-batches of `rows` rows: torch's schedules
        run one shape, so steps of another (another loader's, or find-batch-size's next size)
        get a new one, in place of the last."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if self._train_shape != (chunks, rows):
            cls = Schedule1F1B if self.schedule == "1f1b" else ScheduleGPipe
            if cls is Schedule1F1B and chunks < self.stage.count:
                raise UsageError(
                    f"pp's 1f1b schedule: {chunks} micro-batch(es) per step for {self.stage.count} stages; give the "
                    "loader a micro_batch_size (--micro-batch-size) that makes at least as many, or the gpipe schedule"
                )
            self._train = None  # (its stage's buffers go before the new one's are made)
            self._keep_buffers()  # torch looks at the shapes first, running the stage once
            self._train = cls(self._new_stage(), chunks, loss_fn=self._step_loss, scale_grads=False)
            self._train_shape = (chunks, rows)
        return self._train

    def _step_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(out, y)

    def _new_stage(self) -> Any:
        """torch's PipelineStage over this stage's module, telling `chunk` of each micro-batch."""
        from torch.distributed.pipelining import PipelineStage

        pipeline = self

        class KeyedStage(PipelineStage):
            def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                pipeline.chunk(fwd_chunk_id)
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

            def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                pipeline.chunk(bwd_chunk_id)
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        called = self.module if self.replicas is None else self.replicas  # torch's stage runs DDP's sync
        return KeyedStage(called, self.stage.index, self.stage.count, self.device, group=self.group)

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` through every stage (forward only); the last stage's output, on every stage."""
        from torch.distributed.pipelining import ScheduleGPipe

        # Every stage holds the batch (a pipeline's ranks read the same samples): its shape needs
        # no message; the output's is told once per shape.
        shape = (tuple(x.shape), x.dtype)
        if shape[0][0] == 0:  # an empty batch (lockstep's padding)
            if not self.lockstep:  # nothing to run
                return torch.empty(0, device=self.device)
            # the other data ranks' shards all-gather in this forward too: one row, none returned
            return self.forward(torch.zeros((1, *x.shape[1:]), dtype=x.dtype, device=x.device))[:0]
        if shape not in self._evals:
            self._evals[shape] = ScheduleGPipe(self._new_stage(), 1)
            self._keep_buffers()
        self._running = True
        try:
            out = self._evals[shape].step(*((x,) if self.stage.index == 0 else ()))
        finally:
            self._running = False
        if shape not in self._outputs:
            meta = (tuple(out.shape), out.dtype) if self.stage.is_last else None
            self._outputs[shape] = dist.broadcast_object(meta, src=self.last_rank, group=self.group)
        if not self.stage.is_last:
            size, dtype = self._outputs[shape]
            out = torch.empty(size, dtype=dtype, device=self.device)
        torch.distributed.broadcast(out, src=self.last_rank, group=self.group)
        return out


def padded(queue: list[tuple[Any, Any, Any]], chunks: int, rows: int) -> tuple[list[Any], list[Any], list[Any]]:
    """The step's micro-batches as `chunks` of `rows` rows each: each one padded with zeros,
    all-padding ones added; and each chunk's MicroBatch, `rows` long (what dropout keys its rows
    by)."""
    x0, y0, _ = queue[0]
    xs, ys, micros = [], [], []
    for i in range(chunks):
        if i < len(queue):
            x, y, micro = queue[i]
        else:
            x, y, micro = x0[:0], y0[:0], None
        extra = rows - len(x)
        if extra < 0:
            raise UsageError(f"--strategy pp: a micro-batch of {len(x)} samples, more than the {rows} planned")
        if extra:
            x = torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])
            y = torch.cat([y, y.new_zeros((extra, *y.shape[1:]))])
        xs.append(x)
        ys.append(y)
        start = micro.start if micro is not None else (micros[-1].start + rows if micros else 0)
        base = micro if micro is not None else queue[-1][2]
        micros.append(dataclasses.replace(base, size=rows, start=start, last=False))
    return xs, ys, micros
