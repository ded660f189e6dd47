"""Checkpoint files: written atomically, read without unpickling code.

A write goes to a temp file in the same directory, is flushed to disk, and renamed over the
target, so a crash mid-write leaves the previous file intact; a full disk is an OSError(ENOSPC)
naming the file, not torch's "unexpected pos". Reads use `torch.load(weights_only=True)`:
tensors, numbers, strings and containers only.

A state holding a model sharded by fsdp is saved as a checkpoint directory instead (see
`shards`): every rank writes its own shards through torch's Distributed Checkpoint, nothing is
gathered. Both forms load into any strategy on any number of processes. `state_of` gathers a
sharded model whole when one file is wanted (model.pt).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..core import dist
from ..core.files import load_file, save_file, verify_file  # noqa: F401 - also imported from here
from ..errors import UsageError
from ..strategy import (
    full_model_state,
    holds_dtensors,
    is_sharded,
    load_full_model_state,
    load_full_optimizer_state,
    unwrap,
)
from . import shards


def state_of(value: Any) -> Any:
    """What a checkpoint file stores for `value`: a module's bare state_dict (no `module.` or
    `_orig_mod.` prefixes), anything else's state_dict(), or a plain value as it is. A model
    fsdp sharded is gathered whole (model.pt): collective, and {} on ranks other than 0. (A
    state with an fsdp model is saved as a checkpoint directory instead: see `save`.)"""
    if isinstance(value, torch.nn.Module):
        bare = unwrap(value)
        return full_model_state(bare) if is_sharded(bare) else bare.state_dict()
    if isinstance(value, torch.optim.Optimizer) and holds_dtensors(value):
        raise UsageError("an optimizer of an fsdp model is saved together with its model (one save call)")
    if shards.saved_in_shards(value) and value.sharded:
        raise UsageError("an EMA of an fsdp model is saved together with its model (one save call)")
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return value


def sharded_model(state: dict[str, Any]) -> torch.nn.Module | None:
    """The fsdp-sharded model among `state`'s values, if any."""
    bare = [unwrap(v) for v in state.values() if isinstance(v, torch.nn.Module)]
    return next((m for m in bare if is_sharded(m)), None)


def save(
    path: str | os.PathLike,
    state: dict[str, Any],
    background: bool = False,
    on_complete: Callable[[], None] | None = None,
) -> shards.Pending | None:
    """Rank 0 writes `state` (see `state_of`) to one file; every rank waits until the file is
    complete. The wait does not count against a short collective timeout (see
    dist.wait_for_main). With an fsdp model, `path` becomes a checkpoint directory of every
    rank's shards instead (see `shards.save`; with `background` it is written from a thread,
    and the returned `Pending` says when it is complete). Rank 0 calls `on_complete` once the
    checkpoint is in place. Collective."""
    sharded = sharded_model(state)
    if sharded is not None:
        entries = {key: _bare(value) for key, value in state.items() if shards.in_shards(value)}
        rest = {key: state_of(value) for key, value in state.items() if not shards.in_shards(value)}
        return shards.save(path, entries, sharded, rest, background=background, on_complete=on_complete)
    if dist.is_main():
        save_file(path, {key: state_of(value) for key, value in state.items()})
        if on_complete is not None:
            on_complete()
    dist.wait_for_main()
    return None


def _bare(value: Any) -> Any:
    return unwrap(value) if isinstance(value, torch.nn.Module) else value


def load_into(
    path: str | os.PathLike,
    targets: dict[str, Any],
    map_location: Any = "cpu",
    check: Callable[[set[str]], None] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint and each target's entry into it (modules unwrapped); the whole dict (of
    a checkpoint directory: its entries other than modules and optimizers, which went straight
    into their targets). `check(entry names)` may refuse the checkpoint before anything is
    loaded. Collective for a checkpoint directory or an fsdp target."""
    if shards.is_checkpoint_dir(path):
        if check is not None:
            check(entry_names(path))
        return _load_dir(os.fspath(path), targets)
    state = load_file(path, map_location=map_location)
    if check is not None:
        check(set(state) if isinstance(state, dict) else set())
    sharded = sharded_model(targets)
    for key, target in targets.items():
        if key not in state:
            raise KeyError(f"checkpoint {path} has no entry {key!r}; it has {sorted(state)}")
        load_state(target, state[key], sharded)
    return state


def entry_names(path: str | os.PathLike) -> set[str]:
    """The entries of a checkpoint directory: those in DCP's shards and those of state.pt."""
    saved = shards.read_metadata(path).state_dict_metadata
    return {key.split(".")[0] for key in saved} | set(shards.read_rest(path))


def _load_dir(path: str, targets: dict[str, Any]) -> dict[str, Any]:
    entries = {key: _bare(value) for key, value in targets.items() if shards.in_shards(value)}
    modules = [value for value in entries.values() if isinstance(value, torch.nn.Module)]
    model = sharded_model(targets) or (modules[0] if len(modules) == 1 else None)
    if model is None and any(isinstance(v, torch.optim.Optimizer) for v in entries.values()):
        raise UsageError("an optimizer is loaded from a checkpoint directory together with its (one) model")
    rest = shards.load(path, entries, model)
    for key, target in targets.items():
        if key in entries:
            continue
        if key not in rest:
            raise KeyError(f"checkpoint {path} has no entry {key!r}; it has {sorted(rest)}")
        load_state(target, rest[key])
    return rest


def load_state(target: Any, state: Any, sharded: torch.nn.Module | None = None) -> None:
    """Load `state` into `target` (a module unwrapped). Into an fsdp model, or an optimizer of
    `sharded`, the whole state is loaded and each rank keeps its shards (collective)."""
    if isinstance(target, torch.nn.Module):
        bare = unwrap(target)
        if is_sharded(bare):
            load_full_model_state(bare, state)
        else:
            bare.load_state_dict(state)
    elif isinstance(target, torch.optim.Optimizer) and (sharded is not None or holds_dtensors(target)):
        if sharded is None:
            raise UsageError("an optimizer of an fsdp model is loaded together with its model (one load call)")
        load_full_optimizer_state(sharded, target, state)
    else:
        target.load_state_dict(state)
