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

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core import checks
from ..errors import UsageError

Choice = bool | type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] | None

_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}  # a module class -> its checkpointed subclass


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


def apply(model: nn.Module, choice: Choice) -> list[str]:
    """Checkpoint the modules `choice` picks in `model`, in place; returns their names. A choice
    that picks nothing is a UsageError (a class the model does not use, say)."""
    picked = chosen(model, choice)
    if choice and not picked:
        raise UsageError(
            f"Runtime(activation_checkpointing={checks.shown(choice)}): no module of the model "
            f"({type(model).__name__}) is chosen"
        )
    for _, module in picked:
        if not is_checkpointed(module):
            module.__class__ = _subclass(type(module))
    return [name for name, _ in picked]


def is_checkpointed(module: nn.Module) -> bool:
    # isinstance: fully_shard makes the class a subclass of its own (FSDP<Name>) after the swap
    return isinstance(module, tuple(_SUBCLASSES.values()))


def _subclass(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _SUBCLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(super(made, self).forward, *args, use_reentrant=False, **kwargs)

        made = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
        made.__qualname__ = f"{cls.__qualname__} (activations checkpointed)"
        _SUBCLASSES[cls] = made
    return _SUBCLASSES[cls]
