"""What every strategy shares: the wrapping order, and seeing through wrappers.

`Strategy.wrap` moves a model to its device and wraps it: channels-last layout, then the
precision's autocast innermost (so every DataParallel replica runs it), then torch.compile, then
the strategy's own wrapper (DataParallel apart: see `compile_inside`). `unwrap` takes them all
off again, so DDP's `module.` and torch.compile's `_orig_mod.` prefixes never reach a file.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from ..core.draws import Dropout
from ..core.precision import AutocastModule
from ..errors import UsageError
from .mesh import MeshSpec

if TYPE_CHECKING:
    from ..core.precision import Precision
    from .mesh import Layout

M = TypeVar("M", bound=nn.Module)


class Strategy:
    """One process, one device, the bare model (also what `ddp` runs on a single process)."""

    name: ClassVar[str] = "single"
    # torch.compile the module the strategy's wrapper receives, not the wrapper. torch's "Where
    # to apply torch.compile?" page (2.13) recommends it for DDP: dynamo does not trace DDP's
    # forward (it skips DDP's internals and breaks the graph there), so compiling DDP from the
    # outside compiled nothing at all around an nn.Sequential, whose forward is torch.nn's own.
    # Inside DDP, torch's DDPOptimizer still splits the compiled graph at DDP's bucket
    # boundaries, so the all-reduce keeps overlapping the backward pass.
    compile_inside: ClassVar[bool] = True
    # Every rank must run the same number of forwards (fsdp: each forward all-gathers).
    lockstep: ClassVar[bool] = False
    # check_optimizer does something (fsdp): Runtime.step calls it only then.
    checks_optimizers: ClassVar[bool] = False
    # The parameters are sharded over the ranks (fsdp): checkpoints are DCP directories written
    # by every rank (in the background), a rank's forward alone would wait for the others.
    sharded: ClassVar[bool] = False
    # Ranks other than 0 may build the model on the meta device; setup() fills them (fsdp).
    builds_on_meta: ClassVar[bool] = False
    # Runs in one process whatever the machine has (single, dp): `ddpkit train` starts one.
    one_process: ClassVar[bool] = False
    # Replicas run in threads over pieces of a process's batch (dp): ddpkit's dropout, keyed by
    # the sample's place in the batch, cannot see that place, so torch's stays.
    keeps_torch_dropout: ClassVar[bool] = False
    # torch's SyncBatchNorm works under it (`--sync-batchnorm`); else `refuses_sync_batchnorm`
    # says why (default: that it does not).
    sync_batchnorm: ClassVar[bool] = True
    refuses_sync_batchnorm: ClassVar[str] = ""
    # The --fsdp-* flags are its options.
    takes_fsdp_options: ClassVar[bool] = False
    # `ddpkit find-batch-size` searches under it.
    tunable: ClassVar[bool] = False
    # It keeps several processes in step (ddp, fsdp): on one, its wrapper would only add
    # overhead, and `single` runs instead. Without it, a strategy runs on one process only.
    keeps_ranks_in_step: ClassVar[bool] = False

    # The mesh dimensions it runs on (see ddpkit.strategy.mesh), and the one that names it: a
    # mesh with that dimension runs this strategy when none is asked for (`for_mesh`).
    mesh_dims: ClassVar[tuple[str, ...]] = ("dp",)
    own_dim: ClassVar[str | None] = None
    # Its training steps run through a pipeline schedule (pp): `rt.forward_backward` hands it each
    # micro-batch, and `model(x)` in training is refused.
    pipelined: ClassVar[bool] = False
    # It splits layers by a tensor-parallel plan (tp): Runtime(tp_plan=...) applies to it only.
    takes_tp_plan: ClassVar[bool] = False

    def __init__(self, device: torch.device):
        self.device = device
        self.layout: Layout | None = None  # set by strategy.resolve: where this rank sits
        self.tp_plan: Any = None  # a user's tensor-parallel plan (tp)

    @classmethod
    def default_mesh(cls, world_size: int, local_world_size: int) -> MeshSpec:
        """The mesh it runs on when none is given: every rank a data rank."""
        return MeshSpec((("dp", world_size),))

    @classmethod
    def needs_device_mesh(cls, spec: MeshSpec) -> bool:
        """Whether it runs on torch's DeviceMesh (built by every rank) rather than the plain group."""
        return spec.names != ("dp",)

    def build(self, make: Callable[[], M], rank: int) -> M:
        """`make()`, the model built for `rank` (see Runtime.build): in full, except where the
        strategy `builds_on_meta` on ranks other than 0, where it is built on the meta device
        (in full instead, said, when its constructor cannot run there)."""
        if not self.builds_on_meta or rank == 0:
            return make()
        try:
            with torch.device("meta"):
                return make()
        except Exception as err:  # noqa: BLE001 - a user's constructor: whatever fails on meta
            print(
                f"ddpkit: rank {rank}: the model cannot be built on the meta device ({type(err).__name__}: "
                f"{err}); building it in full on this rank",
                file=sys.stderr,
            )
            return make()

    @classmethod
    def owns(cls, model: nn.Module) -> bool:
        """True for a model this (sharded) strategy wrapped, so that its parameters are this
        rank's shards: a checkpoint holding it is a directory of every rank's shards, its whole
        state is gathered by `full_model_state`, and `rt.evaluate` runs its forwards in
        `lockstep`. (`strategy.sharded_by` asks every registered strategy.)"""
        return False

    @classmethod
    def full_model_state(cls, model: nn.Module) -> dict[str, Any]:
        """The whole state_dict of a model it `owns`, bare keys, on rank 0 (collective)."""
        raise NotImplementedError(f"{cls.name} shards no model")

    @classmethod
    def load_full_model_state(cls, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole state_dict into a model it `owns`: each rank keeps its shards."""
        raise NotImplementedError(f"{cls.name} shards no model")

    @classmethod
    def load_full_optimizer_state(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load an `Optimizer.state_dict()`-format state into the optimizer of a model it `owns`."""
        raise NotImplementedError(f"{cls.name} shards no model")

    @classmethod
    def make(cls, device: torch.device, ddp: Any, fsdp: Any) -> Strategy:
        """The strategy for `device`, with its options among the DDP and FSDP ones given."""
        return cls(device)

    @classmethod
    def runs_as(cls, world_size: int, device: torch.device) -> str:
        """The name of the strategy that runs when this one is asked for on `world_size`
        processes: see `keeps_ranks_in_step`."""
        if cls.keeps_ranks_in_step:
            return "single" if world_size == 1 else cls.name
        if world_size > 1:
            raise UsageError(
                f"--strategy {cls.name} on {world_size} processes would train {world_size} unsynchronized "
                "copies; use --strategy ddp, or one process"
            )
        return cls.name

    @classmethod
    def cpu_collectives(cls, fsdp: Any) -> bool:
        """Whether its process group needs gloo beside NCCL (fsdp's CPU offload)."""
        return False

    @classmethod
    def bytes_per_weight(cls, world_size: int) -> float:
        """Memory per weight a process holds under AdamW in fp32: the weight, its gradient and
        two optimizer values (a sharded strategy holds its share of the last three)."""
        return 16.0

    def prepare_process(self) -> None:
        """Process-wide settings the strategy needs, before the model exists (fsdp on CPU: the
        allocator's)."""

    def devices(self, world_size: int) -> int:
        """How many devices the job's models run on (dp: every visible GPU of its one process)."""
        return world_size

    def arm(self, model: nn.Module, world_size: int) -> bool:
        """After setup() wrapped `model` (the run's one model, uncompiled): whether the first
        backward that reduces must run through `backward` (ddp: to settle its buckets; see
        `DDP.backward`)."""
        return False

    def disarm(self) -> None:
        """No backward of the strategy's own any more (a second model, close())."""

    def backward(self, loss: torch.Tensor, backward: Callable[..., None]) -> bool:
        """Back-propagate `loss` through `backward(**kwargs)` (the precision's backward); returns
        whether a backward of the strategy's own is still to come (see `arm`)."""
        backward()
        return False

    def wrap(
        self,
        model: nn.Module,
        precision: Precision | None = None,
        channels_last: bool = False,
        compile: bool | dict = False,
    ) -> nn.Module:

        model = self._place(model)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if precision is not None and precision.name != "fp32":
            model = AutocastModule(model, precision)
        if compile and self.compile_inside:
            model = _compile(model, compile)
        model = self._wrap(model)
        if compile and not self.compile_inside:
            model = _compile(model, compile)
        return model

    def _place(self, model: nn.Module) -> nn.Module:
        """Move the whole model to the device (fsdp leaves that to sharding: see FSDP._place)."""
        if on_meta(model):
            raise UsageError(
                f"the model is on the meta device (shapes, no values): under {self.name} every rank needs "
                "it built for real (only fsdp on more than one process fills meta-built ranks from rank 0)"
            )
        return model.to(self.device)

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def adopt(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        """Point optimizers built before `wrap` at the wrapped model's parameters (where the
        strategy replaced them: fsdp)."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise UsageError if `optimizer` cannot step this strategy's model (fsdp)."""

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients of `optimizer`'s parameters so that their total 2-norm is at most
        `max_norm`; returns the norm before clipping. (Replicated gradients are whole on every
        rank; a sharded strategy must reduce the norm over its shards instead.)"""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def no_sync(self, model: nn.Module) -> Callable[[], AbstractContextManager[Any]] | None:
        """What makes a context that skips the gradient reduction of the backward passes inside
        it (all but the last micro-batch of a step), or None where nothing is reduced."""
        return None


# torch 2.13's inductor, reordering kernels to lower peak memory, moved the in-place scatter of
# MaxPool2d's backward after the kernel that reads its result: the default CNN's convolutions
# got zero gradients at 30 or 32 samples per forward (measured on CPU; eager and aot_eager
# agree). Off unless the caller's own inductor options say otherwise.
INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}


def _compile(model: nn.Module, options: bool | dict) -> nn.Module:
    # torch.compile(model), an OptimizedModule, rather than model.compile(): the latter compiles
    # nn.Module's own call, a frame in dynamo's skip list, and so compiled nothing for a bare
    # nn.Sequential (measured with torch 2.13). The `_orig_mod.` it adds is what unwrap removes.
    bare = model.module if isinstance(model, AutocastModule) else model
    if _draws_in_its_loop(bare):
        compile_between_draws(bare, options)
        return model
    return torch.compile(model, **compile_options(options))


def _draws_in_its_loop(model: nn.Module) -> bool:
    """Whether `model` is an nn.Sequential (its forward a loop over its children) with ddpkit's
    dropout among its children, drawing (p > 0). The draw breaks the compiled graph (it is
    kept out of graphs: see core.draws), and dynamo does not resume a frame inside a loop:
    torch.compile of the whole model compiled nothing at all (torch 2.13: Linear, ReLU,
    Dropout, Linear gave no graph; a model with a forward of its own breaks where it draws and
    compiles the rest)."""
    return type(model).forward is nn.Sequential.forward and any(_breaks(child) for child in model)


def _breaks(child: nn.Module) -> bool:
    """Whether calling `child` breaks the compiled graph where an nn.Sequential's loop cannot
    resume: ddpkit's dropout drawing, or an nn.Sequential that draws in its own loop (nested:
    it gave no graph either, until it was compiled run by run itself)."""
    return (isinstance(child, Dropout) and child.p > 0) or _draws_in_its_loop(child)


def compile_between_draws(model: nn.Sequential, options: bool | dict) -> None:
    """torch.compile each run of `model`'s children between its dropout modules, in place: the
    loop over the runs and the draws stay eager, each run is compiled whole. A child that is an
    nn.Sequential drawing in its own loop is a boundary too, compiled run by run itself. The
    model keeps its class and parameter names, as under `fsdp.compile_forward`. Each run is a
    function of its own (a code object of its own), so that dynamo's limit of recompilations
    per function (8) is each run's, not shared by all."""
    kwargs = compile_options(options)
    runs: list[tuple[Any, tuple[nn.Module, ...]]] = []  # (compiled chain, or None for a boundary; its modules)
    run: list[nn.Module] = []
    for child in [*model, None]:
        nested = child is not None and _draws_in_its_loop(child)
        if child is not None and not isinstance(child, Dropout) and not nested:
            run.append(child)
            continue
        if nested:
            compile_between_draws(child, options)
        if run:
            code = _chain.__code__.replace(co_name=f"run_{len(runs)}")
            runs.append((torch.compile(types.FunctionType(code, _chain.__globals__), **kwargs), tuple(run)))
            run = []
        if child is not None:
            runs.append((None, (child,)))
    model._ddpkit_runs = runs
    model.forward = types.MethodType(_forward_between_draws, model)


def _forward_between_draws(self: nn.Sequential, x: Any) -> Any:
    for chain, modules in self._ddpkit_runs:
        x = chain(modules, x) if chain is not None else modules[0](x)
    return x


def _chain(modules: tuple[nn.Module, ...], x: Any) -> Any:
    for module in modules:
        x = module(x)
    return x


def compile_options(options: bool | dict) -> dict[str, Any]:
    """torch.compile's keyword arguments for `--compile` (True) or a dict of them."""
    kwargs = dict(options) if isinstance(options, dict) else {}
    if kwargs.get("backend", "inductor") == "inductor" and "mode" not in kwargs:  # torch takes mode or options
        kwargs["options"] = {**INDUCTOR_OPTIONS, **kwargs.get("options", {})}
    return kwargs


def compiled_graphs() -> int:
    """How many graphs torch.compile has produced in this process so far (dynamo's counter)."""
    from torch._dynamo.utils import counters  # torch's compiler: 1.5 s to import, only after a compile

    return int(counters["stats"]["unique_graphs"])


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under any DDP / DataParallel / autocast / torch.compile wrappers."""

    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastModule)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def on_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of `model` is on the meta device (shapes, no values)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded, DTensor) parameter, detached."""
    tensor = tensor.detach()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def eval_view(model: nn.Module) -> nn.Module:
    """The model to evaluate with: without torch.compile (evaluation shapes would compile
    again) and without DDP (whose forward may broadcast buffers, a collective that ranks
    with different numbers of evaluation batches would not all reach). DataParallel and
    autocast stay."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
