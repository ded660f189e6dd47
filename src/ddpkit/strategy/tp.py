"""`tp`: tensor parallel over the mesh's `tp` dimension (torch's `parallelize_module`), with
FSDP2 over its `dp` dimension where that has more than one rank (2-D: `--mesh dp=2,tp=2`).

Each layer the plan names has its weight split over the `tp` ranks: a column-wise linear map
keeps its share of the output features (whole heads of attention, a slice of the MLP's hidden
layer), the row-wise map after it sums the shares back (one all-reduce). The ranks of a `tp`
group read the same samples and, after each row-wise layer, hold the same activations: only the
data dimensions (`dp`) split the batch (see ddpkit.strategy.mesh).

The plan is the model's own `tp_plan(tp_size)` where it has one (ddpkit's gpt: `GPT.tp_plan`),
else `Runtime(tp_plan=...)`: a dict of module names (with `*` wildcards, as
`parallelize_module` takes them) to torch's `ColwiseParallel`, `RowwiseParallel`, ..., or a
callable `(model, tp_mesh) -> None` that parallelizes the model itself. The layers no plan
names keep whole weights on every rank (LayerNorms, a position embedding), which the ranks
update alike: their gradients are the same on every rank of a group.

The logits: the gpt plan gathers them (the output head is column-wise with a replicated output),
so any loss function sees the whole (B, T, vocab) logits, exactly as on one process; the price is
one all-gather of the logits per forward, small for a byte vocabulary (256). Loss parallelism
(`torch.distributed.tensor.parallel.loss_parallel`) would save it for large vocabularies, but
asks the loss to run inside its context; not offered yet.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ..core.precision import AutocastModule
from ..errors import UsageError
from .base import local
from .fsdp import FSDP, any_dtensor, is_sharded
from .mesh import MeshSpec

# Imports inside functions: torch's tensor-parallel and DTensor modules (0.5 s) load where a
# model is parallelized or its norm is taken, not in every run.


class TensorParallel(FSDP):
    """`parallelize_module` over `tp`, then FSDP2 over `dp` (see the module docstring)."""

    name = "tp"
    mesh_dims: ClassVar[tuple[str, ...]] = ("dp", "tp")
    own_dim: ClassVar[str | None] = "tp"
    takes_tp_plan: ClassVar[bool] = True

    @classmethod
    def owns(cls, model: nn.Module) -> bool:
        return is_sharded(model) or holds_dtensor_parameters(model)

    @classmethod
    def default_mesh(cls, world_size: int, local_world_size: int) -> MeshSpec:
        # One tensor-parallel group per machine (its ranks talk at every layer), data parallel across.
        machines, local = MeshSpec.per_machine(world_size, local_world_size)
        return MeshSpec((("dp", machines), ("tp", local)))

    @classmethod
    def needs_device_mesh(cls, spec: MeshSpec) -> bool:
        return True

    def wrap(
        self, model: nn.Module, precision: Any = None, channels_last: bool = False, compile: Any = False
    ) -> nn.Module:
        if self._shards():
            return super().wrap(model, precision, channels_last, compile)
        # One data rank: nothing is sharded, so FSDP2's mixed-precision policy never applies;
        # the precision's autocast does, as under ddp (around the split model: its names stay).
        assert self.layout is not None
        refuse_fp16(self.layout.spec, precision.name if precision is not None else "fp32")
        model = super().wrap(model, None, channels_last, compile)
        if precision is not None and precision.name != "fp32":
            model = AutocastModule(model, precision)
        return model

    @classmethod
    def bytes_per_weight(cls, world_size: int) -> float:
        return 16.0  # what the plan leaves whole is whole on every rank: at most a whole copy

    def _shards(self) -> bool:
        assert self.layout is not None
        return self.layout.spec.size("dp") > 1

    def _shard_mesh(self) -> Any:
        assert self.layout is not None
        return self.layout.sub("dp")

    def _parallelize(self, model: nn.Module) -> None:
        assert self.layout is not None
        tp = self.layout.spec.size("tp")
        parallelize(model, self.layout.sub("tp"), plan_for(model, self.tp_plan, tp))

    def no_sync(self, model: nn.Module) -> Callable[[], Any] | None:
        return super().no_sync(model) if is_sharded(model) else None

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = total_norm(grads)
        # torch's clip_grads_with_norm_ scales them all in one foreach call, which DTensors on
        # two meshes (dp x tp, and dp alone for what the plan left whole) refuse: each rank
        # scales its own parts by the same factor, torch's formula.
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_([local(g) for g in grads], coefficient.to(grads[0].device))
        return norm


def refuse_fp16(spec: MeshSpec, precision: str) -> None:
    """UsageError for fp16 on a tp mesh of one data rank: GradScaler's unscale takes the plan's
    split (DTensor) and whole (plain) gradients in one call, which torch refuses."""
    if precision == "fp16" and spec.size("tp") > 1 and spec.size("dp") == 1:
        raise UsageError(
            f"--mesh {spec}: fp16's loss scaling cannot unscale tp's split and whole gradients together; use bf16, "
            "or a dp dimension (fsdp+tp)"
        )


def parallelize(model: nn.Module, mesh: Any, plan: dict[str, Any] | Callable[[nn.Module, Any], None]) -> None:
    """`model`'s layers split over the tp `mesh` by `plan` (torch's `parallelize_module`, or the
    plan itself where it is a callable); UsageError where torch refuses the plan or it splits
    nothing."""
    from torch.distributed.tensor.parallel import parallelize_module

    # A column-wise layer's gathered output is a view of DTensor's local tensor, which FSDP2
    # warns of at every root whose output it is (in-place ops on it would skip its hook);
    # and gathering a 2-D sharded parameter whole (model.pt) takes two all-gathers, which
    # DTensor logs as slow, and on CPU an all-gather where gloo has no all-to-all. All are
    # how tp works, not news to print from every rank.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for name in ("_redistribute", "_collective_utils"):
        logging.getLogger(f"torch.distributed.tensor.{name}").setLevel(logging.ERROR)
    try:
        if callable(plan):
            plan(model, mesh)
        else:
            # src_data_rank=None: no values are sent here; each rank keeps its part of its own
            # tensors (every rank built the same; under fsdp, FSDP's Rank0Source then fills
            # every part with rank 0's values).
            parallelize_module(model, mesh, plan, src_data_rank=None)
    except (ValueError, TypeError, NotImplementedError, AttributeError) as err:
        # torch's refusals of a plan that does not fit the model (a style on a module it does
        # not split): bad input, one line, on every rank alike
        raise UsageError(f"tp_plan: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not holds_dtensor_parameters(model):
        raise UsageError("--strategy tp: the tensor-parallel plan split no parameter of the model")


def plan_for(model: nn.Module, given: Any, tp_size: int) -> dict[str, Any] | Callable[[nn.Module, Any], None]:
    """The model's `tp_plan(tp_size)`, else the plan given to the Runtime (UsageError: neither)."""
    own = getattr(model, "tp_plan", None)
    if callable(own):
        return own(tp_size)
    if given is None:
        raise UsageError(
            f"--strategy tp: {type(model).__name__} has no tensor-parallel plan; pass Runtime(tp_plan=...) "
            "(module names to ColwiseParallel/RowwiseParallel, see docs/parallelism.md) or give the model "
            "a tp_plan(tp_size) method"
        )
    check_plan(given)
    return given


def check_plan(plan: Any) -> None:
    """A plan is a callable, or a dict of module names to torch's parallel styles (UsageError
    naming what is not)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if callable(plan):
        return
    if not isinstance(plan, dict):
        raise UsageError(
            f"tp_plan: expected a dict of module names to parallel styles or a callable, got {type(plan).__name__}"
        )
    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise UsageError(
                f"tp_plan: {name!r}: {style!r} is not one of torch's parallel styles (ColwiseParallel(), "
                "RowwiseParallel(), ...) for a module name"
            )


def holds_dtensor_parameters(model: nn.Module) -> bool:
    return any_dtensor(model.parameters())


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, whole on every rank: the gradients on one mesh
    (and placement) at a time through torch's `get_total_norm`, each group's norm made whole
    (`full_tensor`: summed over its shards), then added up. Parameters the plan left whole
    have plain gradients, the same on every rank of a tp group: they count once."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack(squares).sum().sqrt()
