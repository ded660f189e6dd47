"""Activation checkpointing: chosen blocks of a model keep only their inputs for the backward
pass, and run their forward again when the backward reaches them (`torch.utils.checkpoint`,
non-reentrant), trading compute for activation memory. An option of every strategy: the same
blocks are checkpointed under single, dp, ddp and fsdp.

Which blocks (`Runtime(activation_checkpointing=...)`, `ddpkit train --activation-checkpointing`):
True checkpoints every direct child of the model that holds parameters, the rule fsdp shards
units by, so each of the built-in models' blocks and stages (gpt: the embedding, every
transformer block, the head); module classes (a class or a tuple) checkpoint every module of
those classes; a callable `(name, module) -> bool` chooses by name. A module inside one already
chosen is not checkpointed again.

How much each chosen block keeps (`mode`, `ddpkit train --activation-checkpointing-mode`):
"full" (the default) keeps its inputs only and recomputes its whole forward; "selective" keeps
besides the outputs of its attention and of every other matrix product (the first, the third,
...), and recomputes the rest: more memory than "full", less compute, which is the trade
torchtitan makes by default for Llama (its per-operation selective checkpointing). The policy is
torch's selective checkpointing (`create_selective_checkpoint_contexts`), counted per block
call, the same in the forward and in its recomputation.

A chosen module gets a subclass of its own class whose forward runs the original through the
checkpoint: its parameters, buffers and state_dict names are untouched (no wrapper, so no
prefix in a checkpoint), `isinstance` still holds, and DataParallel's replicas and FSDP2's
per-unit hooks see a module like any other. The recomputed forward draws the same dropout
masks: torch's through the checkpoint's saved random state, ddpkit's (`core.draws`) because a
mask is keyed by its call site, not drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..core import checks
from ..errors import UsageError

Choice = bool | type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] | None

MODES = ("full", "selective")
_SUBCLASSES: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}  # (module class, mode) -> its subclass


def check(choice: Any) -> None:
    """UsageError unless `choice` is one of the forms above."""
    if choice is None or isinstance(choice, bool) or callable(choice) and not isinstance(choice, type):
        return
    classes = choice if isinstance(choice, tuple) else (choice,)
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return
    raise UsageError(
        f"Runtime(activation_checkpointing=...): True, module classes or a callable (name, module) -> bool, "
        f"not {checks.shown(choice)}"
    )


def chosen(model: nn.Module, choice: Choice) -> list[tuple[str, nn.Module]]:
    """The modules `choice` checkpoints, outermost only, in the model's order."""
    check(choice)
    if not choice:
        return []
    if choice is True:
        picked = [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
    elif isinstance(choice, (type, tuple)):
        picked = [(n, m) for n, m in model.named_modules() if n and isinstance(m, choice)]
    else:
        picked = [(n, m) for n, m in model.named_modules() if n and choice(n, m)]
    outer: list[tuple[str, nn.Module]] = []
    for name, module in picked:  # named_modules lists a parent before its children
        if not any(name.startswith(f"{o}.") for o, _ in outer):
            outer.append((name, module))
    return outer


def apply(model: nn.Module, choice: Choice, mode: str = "full") -> list[str]:
    """Checkpoint the modules `choice` picks in `model`, in place, keeping what `mode` keeps;
    returns their names. A choice that picks nothing is a UsageError (a class the model does not
    use, say)."""
    checks.choice("activation checkpointing mode", mode, MODES)
    picked = chosen(model, choice)
    if choice and not picked:
        raise UsageError(
            f"Runtime(activation_checkpointing={checks.shown(choice)}): no module of the model "
            f"({type(model).__name__}) is chosen"
        )
    for _, module in picked:
        if not is_checkpointed(module):
            module.__class__ = _subclass(type(module), mode)
    return [name for name, _ in picked]


def is_checkpointed(module: nn.Module) -> bool:
    # isinstance: fully_shard makes the class a subclass of its own (FSDP<Name>) after the swap
    return isinstance(module, tuple(_SUBCLASSES.values()))


def _subclass(cls: type[nn.Module], mode: str) -> type[nn.Module]:
    if (cls, mode) not in _SUBCLASSES:
        contexts = {"selective": _selective_contexts}.get(mode)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if contexts is None:
                return checkpoint(super(made, self).forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(super(made, self).forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        made = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        kept = "" if mode == "full" else f", {mode}"
        made.__qualname__ = f"{cls.__qualname__} (activations checkpointed{kept})"
        _SUBCLASSES[cls, mode] = made
    return _SUBCLASSES[cls, mode]


def attention_ops() -> frozenset[Any]:
    """torch's fused attention kernels, forward and backward (CUDA's, and the CPU's), whichever
    this build has: what selective checkpointing keeps, and what the plan times apart."""
    aten = torch.ops.aten
    prefixes = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention")
    names = [n for n in dir(aten) if n.startswith(prefixes)]
    return frozenset(getattr(aten, n).default for n in names if hasattr(getattr(aten, n), "default"))


_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
_ATTENTION = attention_ops()


def _selective_contexts() -> Any:
    """The contexts of one checkpointed call under "selective": attention's outputs and the
    odd-numbered matrix products' kept, everything else recomputed. The products are counted
    apart in the forward and in the recomputation, so both pick the same ones."""
    counts = {False: 0, True: 0}  # products seen: in the forward, in the recomputation

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in _PRODUCTS:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
