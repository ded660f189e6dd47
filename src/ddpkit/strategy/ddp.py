"""`ddp`: DistributedDataParallel, one process per device, gradients all-reduced in buckets
while the backward pass runs."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..core import checks
from ..errors import UsageError
from .base import Strategy

COMM_HOOKS = ("none", "fp16", "bf16")

# What torch says when a forward left parameters unused (pytorch#43259), and what ddpkit adds.
UNUSED_ERROR = "Expected to have finished reduction in the prior iteration"
UNUSED_HINT = (
    "ddpkit: the previous forward left some parameters unused, and DDP waits for their gradients: "
    'pass Runtime(ddp={"find_unused_parameters": True}) (ddpkit train: --find-unused-parameters), '
    "or use every parameter in each forward. torch's message:"
)


@dataclass(frozen=True)
class DDPOptions:
    """DistributedDataParallel's tuning knobs, as flags (`ddpkit bench comm` measures them).

    Attributes:
        bucket_cap_mb: gradients are all-reduced in buckets of this size while backward still
            runs (torch's default 25); bigger buckets mean fewer, larger messages.
        gradient_as_bucket_view: gradients are views into the buckets: saves one copy of the
            gradients in memory and a copy per step.
        static_graph: the set of used parameters never changes between steps, so DDP can skip
            re-checking it (and overlap better); wrong for models with data-dependent branches.
        comm_hook: 'fp16' or 'bf16' all-reduces gradients compressed to 16 bits (half the
            bytes), decompressed before the optimizer step; 'none' all-reduces them as they are.
        find_unused_parameters: let the forward leave parameters unused (a branch it skips):
            DDP then walks the autograd graph after every forward to find them, which costs
            time; without it such a model fails at its second step (3+ ranks: its first; see `UNUSED_HINT`).
        broadcast_buffers: rank 0's buffers (BatchNorm's running statistics) are copied to
            every rank before each forward, as torch does by default; False lets each rank
            keep its own (torch 2.13 calls it `forward_sync_buffers`, and copies them once
            when DDP wraps the model even then).
    """

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: str = "none"
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        checks.choice("--comm-hook", self.comm_hook, COMM_HOOKS)
        for name in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"DDPOptions: {name} is True or False, not {checks.shown(getattr(self, name))}")
        if self.bucket_cap_mb is not None:
            checks.positive("--bucket-cap-mb", self.bucket_cap_mb)

    def check_device(self, device_type: str) -> None:
        """torch allows its bf16 compression hook only with NCCL, that is on CUDA GPUs."""
        if self.comm_hook == "bf16" and device_type != "cuda":
            raise UsageError(
                "--comm-hook bf16 needs CUDA GPUs: torch allows its bf16 hook only with NCCL; "
                "use --comm-hook fp16 on CPU"
            )

    def check_compile(self, compile: bool | dict) -> None:
        """Compiled inside DDP, torch's DDPOptimizer splits the graph at DDP's buckets and
        asserts that none is smaller than DDP's first bucket (1 MiB): say so instead."""
        first_mb = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20) / 2**20
        if compile and self.bucket_cap_mb is not None and self.bucket_cap_mb < first_mb:
            raise UsageError(
                f"--bucket-cap-mb {self.bucket_cap_mb:g} with --compile: torch's compiled DDP needs buckets "
                f"of at least {first_mb:g} MiB"
            )

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
            "find_unused_parameters": self.find_unused_parameters,
        }
        if not self.broadcast_buffers:  # else torch's default, under either name
            out[buffer_sync_argument()] = False
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out


def buffer_sync_argument() -> str:
    """DDP's name for `broadcast_buffers`: torch 2.13 renamed it `forward_sync_buffers` (the
    old name warns); torch 2.4 knows only the old one."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


def comm_hook(name: str) -> Any:
    """The DDP communication hook for `name` (None for 'none')."""

    return {"none": None, "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel wrapper inside `model` (under torch.compile), if any."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return None


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip DDP's gradient all-reduce inside the block (gradient accumulation); else no-op."""
    ddp = find_ddp(model)
    if ddp is None:
        yield
        return
    with ddp.no_sync():
        yield


# DDP reduces a model's first reducing backward in one bucket of every parameter, in the order the
# model registered them; that backward records the order in which the gradients became ready, and
# from the next forward on the buckets are laid out in that order (torch's bucket rebuild). On
# three or more ranks where an element sits in its bucket decides the order in which the all-reduce
# adds the ranks' shares of it (measured with gloo on 3 ranks), so the first step's sums differ in
# their last bits from what the rebuilt layout makes of the same gradients. A run pays that once,
# at its first step; a resumed run paid it again at its own first step, and so was not
# bit-identical to the run it continues. `settled_backward` runs the first reducing backward in the
# rebuilt layout instead. (On two ranks both layouts add the same two numbers.)
SETTLE_FROM_RANKS = 3


def unsettled(model: nn.Module, world_size: int) -> DistributedDataParallel | None:
    """ddpkit's DDP wrapper in `model` whose reducing backward passes still run in DDP's first
    bucket layout, on enough ranks that the layout changes the sums; None if there is nothing
    to settle. Not with find_unused_parameters (DDP never rebuilds then) or static_graph (whose
    first backward DDP reduces in a way of its own)."""
    ddp = find_ddp(model)
    if not isinstance(ddp, DistributedDataParallel) or world_size < SETTLE_FROM_RANKS:
        return None
    if ddp.find_unused_parameters or ddp.static_graph or getattr(ddp, "_has_rebuilt_buckets", True):
        return None
    return ddp


def settled_backward(ddp: DistributedDataParallel, loss: torch.Tensor, backward: Callable[..., None]) -> bool:
    """Run the first reducing backward of `ddp` in the bucket layout every later step uses:
    `backward(**kwargs)` back-propagates `loss` (scaled, under fp16) and takes torch's
    `retain_graph`. Returns False, having run `backward()` once as it is, when the loss's graph
    reaches parameters outside `ddp` (another model, which may be wrapped in a DDP of its own
    that the second pass would leave unreduced).

    A first pass records the order the layout is made from (and is reduced in the first
    layout). Everything it changed is then put back: the gradients of the model's parameters
    and of every other leaf of the loss's graph (the earlier micro-batches' sums, or nothing),
    the model's buffers and the random streams (what activation checkpointing recomputes, such
    as BatchNorm's statistics, is not updated twice). The buckets are laid out again, and the
    backward runs once more as DDP's next step would have run it: the step's sums are then what
    an uninterrupted run's same step makes. Costs a backward pass, an all-reduce, and the graph
    and a copy of the gradients held through both, once per run. The first pass is a whole
    backward (not one limited to the model's parameters), so that parameters used inside
    reentrant activation checkpointing, whose inner backward such a limit would skip, get their
    gradients too. Leaves outside the model that only such an inner backward reaches are not
    seen, and keep both passes' gradients."""
    params = {id(p): p for p in ddp.parameters() if p.requires_grad}
    others = [t for t in graph_leaves(loss) if id(t) not in params]
    if any(isinstance(t, nn.Parameter) for t in others):
        backward()
        return False
    before = [(t, None if t.grad is None else t.grad.clone()) for t in (*params.values(), *others)]
    buffers = [(b, b.clone()) for b in ddp.module.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        backward(retain_graph=True)
    for b, value in buffers:
        b.copy_(value)
    for t, _ in before:
        t.grad = None  # (as zero_grad(set_to_none=True) leaves them when DDP rebuilds after step 1)
    try:  # False if that pass reduced nothing: nothing recorded
        rebuilt = ddp.reducer._rebuild_buckets()
    except RuntimeError as err:  # a parameter the pass left without a gradient: DDP's error, with ours
        if UNUSED_ERROR not in str(err):
            raise
        raise _hinted(err) from None
    for t, grad in before:
        t.grad = grad
    if rebuilt:
        ddp._has_rebuilt_buckets = True
        ddp.reducer.prepare_for_backward([])  # what DDP's forward does before a reducing backward
    backward()
    return True


def graph_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors a backward from `tensor` accumulates gradients into."""
    seen, stack, leaves = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
        if leaf is not None:
            leaves.append(leaf)
        stack.extend(child for child, _ in node.next_functions)
    return leaves


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DistributedDataParallel (under its own name, so a printed model and its class
    name read as before), whose error about unused parameters says how to allow them here:
    torch's own advice names a constructor argument that a ddpkit user never calls."""

    # The last forward armed a reducing backward (read by Runtime.backward while DDP's buckets
    # are unsettled: a backward of the bare module's loss reduces nothing, and settles nothing).
    reducing = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:  # (not a context manager: this runs every step)
            out = super().forward(*inputs, **kwargs)
        except RuntimeError as err:
            if UNUSED_ERROR not in str(err):
                raise
            raise _hinted(err) from None
        if torch.is_grad_enabled():  # (a forward under no_grad leaves DDP's reducer as it was)
            self.reducing = self.require_backward_grad_sync
        return out


def _hinted(err: RuntimeError) -> RuntimeError:
    """DDP's error about parameters a forward left unused, with how to allow them here first."""
    return RuntimeError(f"{UNUSED_HINT}\n{err}")


class DDP(Strategy):
    """DistributedDataParallel with `DDPOptions`; `no_sync` is DDP's own switch."""

    name = "ddp"
    tunable = True
    keeps_ranks_in_step = True

    def __init__(self, device: torch.device, options: DDPOptions = DDPOptions()):
        super().__init__(device)
        self.options = options
        # The DDP wrapper whose first reducing backward runs in the buckets' final layout
        # (`settled_backward`), until it has.
        self._settle: DistributedDataParallel | None = None

    def arm(self, model: nn.Module, world_size: int) -> bool:
        self._settle = unsettled(model, world_size)
        return self._settle is not None

    def disarm(self) -> None:
        self._settle = None

    def backward(self, loss: torch.Tensor, backward: Callable[..., None]) -> bool:
        """The first backward that reduces (the model's last forward armed it, DDP has not laid
        its buckets out again yet) runs twice, in the final layout: see `settled_backward`. Once
        the buckets are rebuilt (by it, or by a backward the loop ran itself), plain backward."""
        ddp = self._settle
        if ddp is None or ddp._has_rebuilt_buckets:
            self._settle = None
            backward()
            return False
        if not (ddp.reducing and ddp.require_backward_grad_sync):  # no reduction armed: not this one
            backward()
            return True
        try:
            # (not settled: the loss reaches another model's parameters)
            if not settled_backward(ddp, loss, backward) or ddp._has_rebuilt_buckets:
                self._settle = None
        finally:
            ddp.reducing = False  # that forward's backward has run
        return self._settle is not None

    @classmethod
    def make(cls, device: torch.device, ddp: Any, fsdp: Any) -> Strategy:
        return cls(device, ddp)

    def _wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, **self.options.kwargs())
        hook = comm_hook(self.options.comm_hook)
        if hook is not None:
            ddp.register_comm_hook(state=None, hook=hook)
        return ddp

    def no_sync(self, model: nn.Module) -> Callable[[], AbstractContextManager[Any]] | None:
        ddp = find_ddp(model)
        return ddp.no_sync if ddp is not None else None
