"""Every random stream of a run: seeding, per-rank streams, DataLoader worker seeds, and the
capture and restore of all of them for checkpoints.

Every rank seeds identically before the model is built (so initial weights agree), then
switches to a stream of its own derived from (seed, rank, step): dropout and sampling then
differ between ranks, reproducibly, and a resumed run can re-derive the same streams.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import dist


def seed_everything(seed: int) -> None:
    """Seed torch, NumPy and `random` identically on every rank, so models start identical."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """Give each rank its own torch / NumPy / `random` stream (dropout, augmentation) derived
    from the run's seed, the rank and the optimizer step the stream starts at."""
    seed_everything(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: NumPy and `random` seeded from the worker's torch seed, which
    the DataLoader derives from the loader's generator (per rank) and the worker id. Without
    this every worker would share the parent's NumPy state and repeat the same augmentations."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class SeedWorker:
    """A DataLoader's worker_init_fn: `seed_worker`, then the user's own function if a DataLoader
    they built had one. A class, not a closure, so that spawned workers can unpickle it."""

    def __init__(self, then: Callable[[int], Any] | None = None):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id)
        if self.then is not None:
            self.then(worker_id)


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """The generator a rank's DataLoader draws its worker seeds from."""
    return torch.Generator().manual_seed(seed * 1_000_003 + rank)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random streams, in a form `torch.load(weights_only=True)` reads back."""
    np_state = np.random.get_state()
    # Python's 625 numbers as one tensor: as a tuple, each is an object to gather and pickle
    # at every checkpoint (half of a small run's checkpoint objects, 3 ms of its 15).
    version, internal, gauss = random.getstate()
    # weights_only loading accepts tensors and plain containers, not NumPy arrays
    return {
        "torch": torch.get_rng_state(),
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(rng: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` captured (tensors may come back on the run's device)."""
    torch.set_rng_state(rng["torch"].cpu())
    version, internal, gauss = rng["python"]
    if isinstance(internal, torch.Tensor):
        internal = internal.tolist()
    random.setstate((version, _as_tuples(internal), gauss))  # (a tuple in checkpoints of ddpkit 0.1)
    kind, keys, *rest = rng["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), *rest))
    if rng["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the tuples that torch.save stores and loads back as they were;
    # be lenient should a list come back.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def gather_rng_states(device: torch.device, generators: list[torch.Generator | None] = ()) -> list[dict[str, Any]]:
    """Every rank's random streams (`rng_state`, plus each of `generators`' state), in rank
    order, on every rank. Collective."""
    state = {**rng_state(device), "generators": [g.get_state() if g is not None else None for g in generators]}
    return gather_states(state)


def restore_rng_states(
    states: list[dict[str, Any]], device: torch.device, generators: list[torch.Generator | None], seed: int, step: int
) -> None:
    """Put this rank's streams back as `gather_rng_states` found them. Saved by another number
    of processes, there is no such rank's stream to restore: each rank starts a fresh one,
    derived from (seed, rank, step) as `seed_rank` does, so the resumed run is still reproducible."""
    if len(states) != dist.world_size():
        seed_rank(seed, dist.rank(), step)
        return
    mine = states[dist.rank()]
    set_rng_state(mine, device)
    for generator, saved in zip(generators, mine.get("generators", [])):
        if generator is not None and saved is not None:
            generator.set_state(saved.cpu())


def gather_states(state: Any) -> list[Any]:
    """Every rank's `state` (dicts, lists and tuples of numbers, strings, None and tensors: a
    rank's random streams), in rank order, on every rank. Collective. The tensors travel as
    their bytes and come back on the CPU: a tensor pickles through torch.save and unpickles
    through torch.load, which made the gather of every rank's streams take twice as long
    (2 ms on 2 gloo processes, measured)."""
    return [_from_bytes(s) for s in dist.gather_objects(_to_bytes(state))]


class _Raw(tuple):
    """A tensor as (dtype name, shape, bytes)."""


def _to_bytes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bf16 included
        return _Raw((str(t.dtype).removeprefix("torch."), tuple(t.shape), data))
    return _each(value, _to_bytes)


def _from_bytes(value: Any) -> Any:
    if isinstance(value, _Raw):
        dtype, shape, data = value
        kind = getattr(torch, dtype)
        if not data:
            return torch.empty(shape, dtype=kind)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)
    return _each(value, _from_bytes)


def _each(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with `fn` applied to each item of its dicts, lists and tuples (named ones too)."""
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(fn(v) for v in value)
    return value
