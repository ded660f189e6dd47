"""`fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`), parameters, gradients and optimizer
state sharded over the processes; each unit's parameters are all-gathered for its forward and
backward, and its gradients reduce-scattered.

FSDP2 changes the model in place: its class becomes `FSDP<Name>` and its parameters DTensors.
There is no wrapper and no key prefix, so `unwrap` returns the model itself. Three things
differ from DDP, and are handled here and where noted:

- An optimizer built before `fully_shard` points at the replaced parameters: `adopt` points it
  at the sharded ones (Runtime.setup calls it).
- Every forward all-gathers, so every rank must run the same number of forwards (`lockstep`):
  the training sampler pads micro-batches and exact evaluation pads batches, with empty ones.
- A state_dict holds shards: checkpoints are directories of every rank's shards (see
  ddpkit.checkpoint.shards); model.pt gathers the whole model, a collective (`full_model_state`).

Two things that `Strategy.wrap` does for the other strategies are done differently here:
bf16/fp16 is FSDP2's `MixedPrecisionPolicy`, not the autocast wrapper, and `--compile` compiles
each shard unit's forward, not the whole model (see `FSDP.wrap`).

Initial weights are rank 0's, as under DDP (which broadcasts them when it wraps): the other ranks
may build the model on the meta device (`Runtime.build`), with shapes and no memory, and their
shards are filled from rank 0's full model after sharding (see `Rank0Source`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..core import allocator, checks, dist
from ..errors import UsageError
from .base import Strategy, compile_options, on_meta

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from ..core.precision import Precision

# Imports inside functions: torch's FSDP and DCP modules (about half a second each to import)
# load where they are used, not in every run (ddp too imports this module).

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _options(save: bool) -> Any:
    """Gathered on every rank, kept on rank 0 only, in CPU memory: what a checkpoint file holds;
    on load every rank passes the whole file's state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True) if save else StateDictOptions(full_state_dict=True)


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2's knobs.

    Attributes:
        units: which submodules are sharded as units of their own (each all-gathered on its
            own, just before its forward), before the root takes the rest: module classes (a
            class or a tuple of them), or a callable `(name, module) -> bool`. Default: every
            direct child of the model that holds parameters.
        reshard_after_forward: free a unit's gathered parameters after its forward (gathered
            again for backward): less memory, one more all-gather per unit and step.
        reduce_dtype: 'fp32', 'bf16' or 'fp16': the dtype gradients are reduce-scattered (and,
            between the micro-batches of a step, accumulated) in. Under `--precision bf16|fp16`
            the backward computes in that dtype; fp32 (the default) sums the ranks' gradients
            without rounding them to 16 bits; bf16/fp16 halve the bytes sent.
        cpu_offload: keep the sharded parameters, their gradients and the optimizer state in
            host memory (FSDP2's `CPUOffloadPolicy`; the optimizer steps on the CPU), copied to
            the device for each unit's all-gather. On a CPU device they are there already: it
            runs, and changes nothing.
    """

    units: type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] | None = None
    reshard_after_forward: bool = True
    reduce_dtype: str = "fp32"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        checks.choice("--fsdp-reduce-dtype", self.reduce_dtype, REDUCE_DTYPES)

    def is_unit(self, name: str, module: nn.Module) -> bool:
        if self.units is None:
            return "." not in name and any(True for _ in module.parameters())
        if isinstance(self.units, (type, tuple)):
            return isinstance(module, self.units)
        return bool(self.units(name, module))


def is_sharded(model: nn.Module) -> bool:
    """True for a model that FSDP's `_wrap` sharded (its root is an FSDPModule)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing was sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def any_dtensor(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of `tensors` is a DTensor (a strategy's shard or slice)."""
    tensor = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    return tensor is not None and any(isinstance(t, tensor.DTensor) for t in tensors)


def holds_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    return any_dtensor(p for group in optimizer.param_groups for p in group["params"])


@contextlib.contextmanager
def no_sync(model: FSDPModule) -> Iterator[None]:
    """FSDP2's gradient-sync switch (it has no no_sync()): backward passes inside keep their
    unsharded gradients and skip the reduce-scatter, which the next synced backward does."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


NO_SYNC_BATCHNORM = "--strategy fsdp does not support SyncBatchNorm (--sync-batchnorm) yet; use --strategy ddp"


class FSDP(Strategy):
    """FSDP2 over this job's processes (see the module docstring)."""

    name = "fsdp"
    lockstep: ClassVar[bool] = True
    checks_optimizers: ClassVar[bool] = True
    sharded: ClassVar[bool] = True
    builds_on_meta: ClassVar[bool] = True
    sync_batchnorm: ClassVar[bool] = False
    refuses_sync_batchnorm: ClassVar[str] = NO_SYNC_BATCHNORM
    takes_fsdp_options: ClassVar[bool] = True
    tunable: ClassVar[bool] = True
    keeps_ranks_in_step: ClassVar[bool] = True

    @classmethod
    def owns(cls, model: nn.Module) -> bool:
        return is_sharded(model)

    @classmethod
    def full_model_state(cls, model: nn.Module) -> dict[str, Any]:
        return full_model_state(model)

    @classmethod
    def load_full_model_state(cls, model: nn.Module, state: dict[str, Any]) -> None:
        load_full_model_state(model, state)

    @classmethod
    def load_full_optimizer_state(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        load_full_optimizer_state(model, optimizer, state)

    @classmethod
    def make(cls, device: torch.device, ddp: Any, fsdp: Any) -> Strategy:
        return cls(device, fsdp)

    @classmethod
    def cpu_collectives(cls, fsdp: Any) -> bool:
        # Offloaded shards and their gradients are CPU tensors: reducing them (the clipping norm,
        # fp16's inf check, the finite check) on CUDA needs gloo beside NCCL, as torchtitan does.
        return bool(fsdp.cpu_offload)

    @classmethod
    def bytes_per_weight(cls, world_size: int) -> float:
        return 4 + 12 / world_size  # one whole copy at build time, shares of the rest

    def prepare_process(self) -> None:
        if self.device.type == "cpu":
            # Before the model exists: gathered parameters, freed after each use, go back to the
            # system instead of piling up in glibc's heap (see ddpkit.core.allocator).
            allocator.mmap_large_blocks()

    def __init__(self, device: torch.device, options: FSDPOptions = FSDPOptions()):
        super().__init__(device)
        self.options = options
        self._moved: dict[int, nn.Parameter] = {}  # id of a parameter before sharding -> after
        self._checked: set[int] = set()  # optimizers check_optimizer accepted
        self._param_dtype: torch.dtype | None = None  # bf16/fp16: the policy's; set by wrap
        self._compile: bool | dict = False

    def wrap(
        self,
        model: nn.Module,
        precision: Precision | None = None,
        channels_last: bool = False,
        compile: bool | dict = False,
    ) -> nn.Module:
        # No AutocastModule here. FSDP2's MixedPrecisionPolicy all-gathers the parameters in
        # bf16/fp16 and runs every unit's forward and backward on them and on inputs cast to
        # that dtype, while the sharded copy the optimizer steps stays fp32; the root's outputs
        # come back in fp32, so the loss is computed in full precision, as AutocastModule
        # promises. The matrix products see the same bf16 operands as under autocast (which casts
        # the fp32 weights per op); what differs is the ops autocast keeps in fp32 (softmax,
        # norms, reductions), which here run in bf16 inside a unit. Autocast on top would make no
        # parameter smaller, and as the root module it would put `module.` into every name
        # fully_shard and the DCP state dicts see. Measured on CPU (docs/fsdp.md): bf16 and
        # fp16 give ddp's autocast weights bit for bit on 2 processes (tests/core/test_strategy.py).
        # Evaluation (evaluation.py) runs the forward under the precision's autocast as well.
        self._param_dtype = precision.dtype if precision is not None and precision.name != "fp32" else None
        # torch.compile from outside a sharded model compiled nothing (torch 2.13: dynamo skips
        # FSDP2's hooks and nn.Sequential's forward): each unit's forward is compiled in _wrap.
        self._compile = compile
        return super().wrap(model, None, channels_last, False)

    def _place(self, model: nn.Module) -> nn.Module:
        # fully_shard moves each unit's parameters and buffers to the device as it shards them
        # (and leaves meta tensors on meta), so rank 0's full model never needs to fit the device
        # whole: it stays in host memory until its values are broadcast (see Rank0Source).
        return model

    def _wrap(self, model: nn.Module) -> nn.Module:
        check_model(model)
        source = Rank0Source.take(model)  # before fully_shard replaces rank 0's full parameters
        before = dict(model.named_parameters())
        self.split(model)
        if any(True for _ in model.buffers()):
            model.register_forward_pre_hook(_broadcast_buffers)
        # Offloaded shards live in host memory (CPUOffloadPolicy): allocate them there.
        source.fill(model, torch.device("cpu") if self.options.cpu_offload else self.device)
        # After the fill: on a meta-built rank, to_empty replaced what no strategy split (tp on
        # one dp rank leaves LayerNorms whole).
        after = dict(model.named_parameters())  # same names: FSDP2 and tp add no prefix
        self._moved = {id(before[name]): after[name] for name in before}
        del before
        return model

    def split(self, model: nn.Module, precision: Precision | None = None) -> None:
        """Split `model` in place over the layout as a run does, values aside: tensor-parallel
        where the mesh has tp, then FSDP2 on each unit and the root (with `precision`'s policy,
        where given). `wrap` fills the shards from rank 0 afterwards; `ddpkit plan` calls this
        alone, on fake tensors."""
        from torch.distributed.fsdp import fully_shard

        if precision is not None:
            self._param_dtype = precision.dtype if precision.name != "fp32" else None
        self._parallelize(model)
        shards = self._shards()
        # Deepest first: fully_shard on a module leaves the parameters of sharded submodules alone.
        for name, module in reversed(list(model.named_modules())):
            if name and self.options.is_unit(name, module):
                if self._compile:
                    compile_forward(module, self._compile)
                if shards:
                    fully_shard(module, **self._shard_kwargs(root=False))
        if shards:
            fully_shard(model, **self._shard_kwargs(root=True))

    def _shard_kwargs(self, root: bool) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(
            param_dtype=self._param_dtype,
            reduce_dtype=REDUCE_DTYPES[self.options.reduce_dtype],
            # Only the root's outputs: between units they stay in the compute dtype.
            output_dtype=torch.float32 if root and self._param_dtype is not None else None,
        )
        kwargs: dict[str, Any] = {"reshard_after_forward": self.options.reshard_after_forward, "mp_policy": policy}
        mesh = self._shard_mesh()
        if mesh is not None:
            kwargs["mesh"] = mesh
        if self.options.cpu_offload:
            # Pinned host memory needs an accelerator (torch 2.13 raises without one).
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        return kwargs

    def _shards(self) -> bool:
        """Whether fully_shard runs at all (tp on a mesh of one dp rank: no)."""
        return True

    def _parallelize(self, model: nn.Module) -> None:
        """Before sharding: split the model along the mesh's other dimensions (tp)."""

    def _shard_mesh(self) -> Any:
        """The DeviceMesh fully_shard shards over: the layout's, where it has one (`ddpkit plan`
        gives it one on its fake process group); else None, every process (torch's default)."""
        return self.layout.sub("dp") if self.layout is not None else None

    def adopt(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        """Point optimizers built on the model before setup() at its sharded parameters."""
        for opt in optimizers:
            if opt.state:
                raise UsageError("under fsdp, pass setup() an optimizer that has not stepped yet")
            for group in opt.param_groups:
                group["params"] = [self._moved.get(id(p), p) for p in group["params"]]
        self._moved = {}

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._checked:
            return
        if not holds_dtensors(optimizer):
            raise UsageError(
                "under fsdp the optimizer must be passed to setup() (or built after it): this one holds the "
                "parameters fully_shard replaced, and would train nothing"
            )
        self._checked.add(id(optimizer))

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        # torch's clip_grad_norm_ on DTensor gradients reduces the norm over all shards already;
        # it returns a replicated DTensor.
        norm = super().clip_grad_norm(optimizer, max_norm)
        from torch.distributed.tensor import DTensor

        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def no_sync(self, model: nn.Module) -> Callable[[], AbstractContextManager[Any]] | None:
        return (lambda: no_sync(model)) if is_sharded(model) else None


def compile_forward(module: nn.Module, options: bool | dict) -> None:
    """torch.compile `module`'s forward in place, as torchtitan compiles each block before
    sharding it: FSDP2's hooks around it stay eager (dynamo skips them), and the module keeps its
    class and parameter names (torch.compile(module) would add `_orig_mod.` to them)."""
    module.forward = torch.compile(module.forward, **compile_options(options))


# SyncBatchNorm's forward is a collective of its own, and fsdp runs empty micro-batches to keep
# the ranks in step: not tried yet (it runs on GPUs only).


def check_model(model: nn.Module) -> None:
    """Refuse what fsdp cannot shard with ddpkit's promises intact."""
    if any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise UsageError(NO_SYNC_BATCHNORM)


def _broadcast_buffers(model: nn.Module, args: Any) -> None:
    """Before each training forward, every rank takes rank 0's buffers (BatchNorm's running
    statistics), as DDP does: the ranks' copies then agree at every step, and a checkpoint and
    evaluation see rank 0's, as under ddp. (Every rank runs as many forwards: lockstep.)"""
    if model.training:
        dist.broadcast_tensors(list(model.buffers()))


@dataclass
class Rank0Source:
    """Rank 0's full model, the one source of every rank's initial shards.

    Rank 0 builds the model as one process would (same seed, same draws from the random stream:
    bit-identical values), the other ranks may build it on the meta device. Filling each rank's
    shards from one seeded source in some other way (say, each rank initializing its own shard
    under a seed) cannot reproduce the sequential random draws of an arbitrary module's
    constructor, so the values come from rank 0: its full copy sits in host memory once, next
    to its shards, and is freed after the broadcast. The other ranks receive one tensor at a
    time (torch's `set_model_state_dict(broadcast_from_rank0=True)`), so they never hold more
    than their shards plus the largest tensor.

    Buffers are not sharded: persistent ones come with the state dict, non-persistent ones (not
    in any state dict, e.g. a causal mask) are broadcast from rank 0 one by one.
    """

    full: dict[str, Any] = field(default_factory=dict)  # rank 0's state_dict (the model's own tensors)
    buffers: list[str] = field(default_factory=list)  # rank 0's non-persistent buffers
    meta_here: bool = False  # this rank's model was built on meta: allocate it after sharding

    @classmethod
    def take(cls, model: nn.Module) -> Rank0Source:
        """Every rank learns what rank 0 holds. Collective; every rank raises UsageError together
        when rank 0 has no values to give."""
        meta = on_meta(model)
        full = model.state_dict() if dist.rank() == 0 and not meta else {}
        names = [name for name, _ in model.named_buffers() if name not in full]
        rank0_meta, buffers = dist.broadcast_object((meta, names))
        if rank0_meta:
            raise UsageError(
                "under fsdp, rank 0 must build the model for real (its values are every rank's initial "
                "weights); only the other ranks may build it on the meta device (Runtime.build does so)"
            )
        return cls(full, buffers, meta)

    def fill(self, model: nn.Module, device: torch.device) -> None:
        """After fully_shard: give every rank its shards (and buffers) of rank 0's values."""
        from torch.distributed import broadcast
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.meta_here:
            model.to_empty(device=device)  # uninitialized shards and buffers, filled below
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        full, self.full = self.full, {}
        set_model_state_dict(model, full, options=options)
        del full  # rank 0's full copy: freed here
        named = dict(model.named_buffers())
        for name in self.buffers:
            broadcast(named[name], src=0)


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """The sharded model's whole state_dict, bare keys, on rank 0 (CPU); {} elsewhere.
    Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(save=True))


def load_full_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a whole (unsharded) state_dict into the sharded model: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(save=False))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an `Optimizer.state_dict()`-format state (from any strategy) into the sharded one."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {id(p): fqn for fqn, p in model.named_parameters()}
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, optimizer.param_groups)
    ):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    fqn_of: dict[int, str] = {}
    groups = []
    for saved, group in zip(saved_groups, optimizer.param_groups):
        fqns = [names[id(p)] for p in group["params"]]
        fqn_of.update(zip(saved["params"], fqns))
        groups.append({**saved, "params": fqns})
    full = {"state": {fqn_of[i]: s for i, s in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, full, options=_options(save=False))
