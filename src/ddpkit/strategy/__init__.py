"""How a model is spread over devices, one module per strategy: `single` (the bare model),
`dp` (nn.DataParallel), `ddp` (DistributedDataParallel), `fsdp` (FSDP2, sharded), `hsdp`
(FSDP2 on a replicate x dp mesh), `tp` (tensor parallel, with FSDP2 over dp) and `pp` (pipeline
stages of an nn.Sequential).

The layout of the processes is a mesh (`--mesh dp=2,tp=2`, see `mesh`): a mesh naming a
dimension of one strategy's own (`tp`, `replicate`, `pp`) runs that strategy when no other is asked
for (`for_mesh`).

`resolve` turns a requested name into the strategy that will actually run on this many
processes: `ddp` or `fsdp` on one process is `single`; `dp` without two GPUs is `single` too.
Everything that differs between them is the strategy's own (its class attributes and methods):
nothing outside strategy/ tests a strategy's name or type (tests/test_strategy_seam.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core import checks
from ..errors import UsageError, usage_errors
from .base import Strategy, compiled_graphs, eval_view, local, unwrap
from .ddp import (
    COMM_HOOKS,
    DDP,
    DDPOptions,
    DistributedDataParallel,
    comm_hook,
    find_ddp,
    no_sync,
    settled_backward,
    unsettled,
)
from .dp import DataParallel
from .fsdp import FSDP, FSDPOptions, holds_dtensors
from .hsdp import HSDP
from .mesh import Layout, MeshSpec
from .pp import SCHEDULES, PipelineParallel, micro_batch_size, refuse_options, split_stages, stage_of
from .single import Single
from .tp import TensorParallel, check_plan, plan_for, refuse_fp16

# The one registry: a strategy is a module of strategy/ with a Strategy subclass, and an entry
# here (`register` adds one from outside, as a test's own strategy does).
REGISTRY: dict[str, type[Strategy]] = {
    # (`sharded_by` asks in this order: tp's models are fsdp's too where dp > 1)
    cls.name: cls
    for cls in (DDP, DataParallel, TensorParallel, FSDP, HSDP, PipelineParallel, Single)
}
DEFAULT = "ddp"  # what runs when nothing is asked for (and what a mesh's own strategy replaces)
STRATEGIES = tuple(sorted(REGISTRY))  # the names at import (the registry may grow: `names()`)

__all__ = [
    "COMM_HOOKS",
    "REGISTRY",
    "SCHEDULES",
    "STRATEGIES",
    "DDPOptions",
    "DistributedDataParallel",
    "FSDPOptions",
    "Layout",
    "MeshSpec",
    "Strategy",
    "by_name",
    "applies_tp_plan",
    "check_model",
    "check_plan",
    "comm_hook",
    "compiled_graphs",
    "eval_view",
    "for_mesh",
    "find_ddp",
    "full_model_state",
    "holds_dtensors",
    "is_sharded",
    "load_full_model_state",
    "load_full_optimizer_state",
    "local",
    "lockstep",
    "micro_batch_size",
    "names",
    "no_sync",
    "plan_for",
    "register",
    "resolve",
    "resolve_name",
    "settled_backward",
    "sharded_by",
    "split_stages",
    "stage_of",
    "unsettled",
    "unwrap",
]


def sharded_by(model: nn.Module) -> type[Strategy] | None:
    """The registered strategy that sharded `model` (its `owns`), or None: a replicated model.
    A pipeline owns its stage whatever else split it (pp x tp: tp's DTensors inside)."""
    owners = [cls for cls in REGISTRY.values() if cls.sharded and cls.owns(model)]
    return min(owners, key=lambda cls: not cls.pipelined, default=None)


def is_sharded(model: nn.Module) -> bool:
    """Whether a strategy sharded `model` (see `Strategy.owns`)."""
    return sharded_by(model) is not None


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """A sharded model's whole state_dict, bare keys, on rank 0 (collective; {} elsewhere)."""
    return _owner(model).full_model_state(model)


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a whole state_dict into a sharded model: each rank keeps its shards (collective)."""
    _owner(model).load_full_model_state(model, state)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an `Optimizer.state_dict()`-format state (of any strategy) into a sharded model's optimizer."""
    _owner(model).load_full_optimizer_state(model, optimizer, state)


def lockstep(model: nn.Module) -> bool:
    """Whether every rank must run as many forwards of `model` (its strategy's `lockstep`)."""
    owner = sharded_by(model)
    return owner is not None and owner.lockstep


def _owner(model: nn.Module) -> type[Strategy]:
    owner = sharded_by(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} is not sharded by any strategy")
    return owner


def names() -> tuple[str, ...]:
    """Every strategy's name, sorted."""
    return tuple(sorted(REGISTRY))


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy to the registry under its `name` (usable as a class decorator). A class
    must name itself (not inherit a name) and take a name no other strategy has."""
    if "name" not in cls.__dict__:
        raise ValueError(f"{cls.__qualname__}: a strategy names itself (name = ...), or it would take its base's")
    if cls.sharded and cls.owns.__func__ is Strategy.owns.__func__:
        raise ValueError(
            f"{cls.__qualname__}: a sharded strategy says which models are its own (owns), or its "
            "checkpoints would be one file of rank 0's shards"
        )
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(
            f"{cls.__qualname__}: the strategy name {cls.name!r} is taken by {REGISTRY[cls.name].__qualname__}"
        )
    REGISTRY[cls.name] = cls
    return cls


def by_name(name: str) -> type[Strategy]:
    """The strategy asked for as `name` (a UsageError for an unknown one)."""
    checks.choice("--strategy", name, names())
    return REGISTRY[name]


def resolve_name(name: str, world_size: int, device: torch.device) -> str:
    """The strategy that will actually run for `name` on `world_size` processes."""
    return by_name(name).runs_as(world_size, device)


def for_mesh(name: str, mesh: MeshSpec | None) -> str:
    """The strategy asked for: `name`, except that a mesh naming a dimension of one strategy's
    own (`tp`, `replicate`) picks that strategy where `name` is the default. A UsageError where
    the mesh has a dimension the strategy does not run on."""
    if mesh is None:
        return name
    owned = {cls.own_dim: cls.name for cls in REGISTRY.values() if cls.own_dim in mesh.names}
    if len(owned) > 1:  # the one of them that runs on every dimension of the mesh (pp on pp x tp)
        owners = [n for n in owned.values() if set(mesh.names) <= set(REGISTRY[n].mesh_dims)]
        if len(owners) != 1:
            raise UsageError(f"--mesh {mesh}: no strategy runs on {' and '.join(sorted(owned))} together yet")
    else:
        owners = list(owned.values())
    if name == DEFAULT and owners:
        name = owners[0]
    cls = by_name(name)
    extra = [dim for dim in mesh.names if dim not in cls.mesh_dims]
    if extra:
        owner = next((c.name for c in REGISTRY.values() if c.own_dim == extra[0]), None)
        hint = f"; {extra[0]} needs --strategy {owner}" if owner else ""
        raise UsageError(f"--mesh {mesh}: --strategy {name} runs on {', '.join(cls.mesh_dims)} only{hint}")
    return name


def mesh_for(
    cls: type[Strategy], mesh: MeshSpec | None, world_size: int, local_world_size: int, what: str = "--mesh"
) -> MeshSpec:
    """The mesh `cls` runs on: `mesh`, checked against the number of processes, or its default."""
    if mesh is None:
        return cls.default_mesh(world_size, local_world_size)
    mesh.check_processes(world_size, what)
    return mesh


def applies_tp_plan(name: str, mesh: MeshSpec | None) -> bool:
    """Whether a tensor-parallel plan applies to strategy `name` on `mesh`: under tp, and under a
    strategy that takes one (pp) where the mesh has a tp dimension."""
    cls = by_name(for_mesh(name, mesh))
    return cls.takes_tp_plan and (cls.own_dim == "tp" or (mesh is not None and mesh.size("tp") > 1))


def check_model(spec: MeshSpec, model: nn.Module, name: str, precision: str, compile: bool = False) -> None:
    """One line (UsageError) where `model` (`--model name`, built on the meta device: shapes
    only) cannot run on the mesh `spec`: under tp, without a tensor-parallel plan of its own or
    with a bad one; under pp, with fp16 or compile, or where it does not split into the stages."""
    tp, pp = spec.size("tp"), spec.size("pp")
    if pp == 1:
        refuse_fp16(spec, precision)  # (under pp, fp16 is refused whatever the mesh: below)
    if tp > 1:
        own = getattr(model, "tp_plan", None)
        if not callable(own):
            raise UsageError(
                f"--strategy tp: {name} has no tensor-parallel plan: a model brings its own as a tp_plan(tp_size) "
                "method (the built-in gpt has one; see docs/parallelism.md)"
            )
        try:
            with usage_errors():
                check_plan(own(tp))
        except UsageError as err:
            message = str(err)
            raise UsageError(
                message if message.startswith("--mesh") else f"--model {name}: tp_plan({tp}): {err}"
            ) from None
    if pp > 1:
        refuse_options(f"--mesh {spec}", precision, compile)
        split_stages(model, pp)  # one line if it cannot be split so


def resolve(
    name: str,
    world_size: int,
    device: torch.device,
    ddp: DDPOptions = DDPOptions(),
    fsdp: FSDPOptions = FSDPOptions(),
    mesh: MeshSpec | None = None,
    local_world_size: int | None = None,
) -> Strategy:
    """The `Strategy` object that runs `name` here (see `resolve_name`), on `mesh` (see
    `for_mesh`). Where the strategy runs on torch's DeviceMesh, every rank builds it here:
    collective."""
    name = for_mesh(name, mesh)
    local = world_size if local_world_size is None else local_world_size
    spec = mesh_for(by_name(name), mesh, world_size, local, "Runtime(mesh=...)")
    strategy = REGISTRY[resolve_name(name, world_size, device)].make(device, ddp, fsdp)
    mesh_needed = world_size > 1 and type(strategy).needs_device_mesh(spec)
    strategy.layout = Layout.build(spec, device) if mesh_needed else Layout.plain(world_size)
    return strategy
