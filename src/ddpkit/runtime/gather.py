"""Exactly-once gathering of per-sample values over an evaluation pass (`rt.gather`).

`rt.eval_loader` gives rank r of W the dataset's samples r, r+W, r+2W, ... in order, with no
padding (shares differ by at most one sample; a rank may have none). So sample i is value
i // W of rank i % W, and `gather` puts every rank's values back in dataset order, each sample
once, on every rank. (DistributedSampler instead pads the shares with repeated samples, which
a plain all_gather then counts twice.)

What a rank passes, its values over its whole share in the loader's order:

- a tensor whose first dimension is the samples, gathered with `dist.all_gather`: its dtype
  and its other dimensions must agree over the ranks;
- a list of one picklable object per sample (strings, token lists, tensors of varying shape),
  gathered with `dist.gather_objects`;
- a dict (any Mapping) or a tuple (namedtuples too) of these, nested as deep as you like, with
  the same number of samples in every leaf. A list is always a leaf, never a container: put
  several things to gather in a dict or a tuple.

A `Collector` builds these batch by batch. A rank whose share is empty may pass None (or an
empty Collector): it then gets the structure the others passed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core import dist
from ..errors import UsageError


@dataclass(frozen=True)
class _Leaf:
    """What the ranks must agree on about one leaf: a tensor's dtype and per-sample shape, or
    that it is a list of objects."""

    kind: str  # "tensor" or "objects"
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        dims = ", ".join(["n", *map(str, self.shape)])
        return "a list" if self.kind == "objects" else f"a {self.dtype} tensor of shape ({dims})"


def _map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """`obj` with `fn` applied to each leaf, keeping the dicts and tuples around them."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map(fn, o) for o in obj))
    if isinstance(obj, tuple):
        return tuple(_map(fn, o) for o in obj)
    if isinstance(obj, Mapping):
        mapped = {k: _map(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except TypeError:
            return mapped
    return fn(obj)


def _leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) for each leaf of `obj`, in the order `_map` visits them."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, tuple):
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, i))
    else:
        yield path, obj


def _describe(leaf: Any) -> _Leaf:
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        return _Leaf("tensor", leaf.dtype, tuple(leaf.shape[1:]))
    if isinstance(leaf, list):
        return _Leaf("objects")
    raise UsageError(
        f"rt.gather takes tensors whose first dimension is the samples, lists of one object per "
        f"sample, and dicts or tuples of these; not {_kind(leaf)}"
    )


def _kind(leaf: Any) -> str:
    return "a 0-d tensor" if isinstance(leaf, torch.Tensor) else f"a value of type {type(leaf).__name__}"


def _signature(values: Any) -> list[tuple[tuple, _Leaf]]:
    """Where each leaf of `values` sits and what it is: equal for structures that gather together."""
    return [(path, _describe(leaf)) for path, leaf in _leaves(values)]


def samples(values: Any) -> int:
    """The number of samples `values` holds (every leaf must hold as many)."""
    _signature(values)  # only accepted leaves
    counts = {path: len(leaf) for path, leaf in _leaves(values)}
    if not counts:
        raise UsageError("rt.gather: the values hold no tensor and no list")
    if len(set(counts.values())) > 1:
        raise UsageError(f"rt.gather: every part of the values must hold one value per sample; they hold {counts}")
    return next(iter(counts.values()))


class Collector:
    """Per-sample values collected batch by batch over an evaluation pass, for `rt.gather`:

        seen = Collector()
        for x, y in rt.eval_loader(test_set, batch_size=64):
            seen.add({"pred": model(x).argmax(1), "label": y})
        everything = rt.gather(seen)  # {"pred": ..., "label": ...} of the whole set, in order

    On a rank whose share is empty it collects nothing, and `rt.gather` gives it the structure
    the other ranks collected.
    """

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def add(self, values: Any) -> None:
        """One batch's values (a structure `rt.gather` takes); tensors are detached."""
        self.batches.append(_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, values))

    def values(self) -> Any:
        """The batches joined, tensors along their first dimension and lists one after the other;
        None before the first batch."""
        if not self.batches:
            return None
        first = _signature(self.batches[0])
        for i, batch in enumerate(self.batches):
            if _signature(batch) != first:
                raise UsageError(f"Collector: batch {i}'s values are not shaped like batch 0's")
        columns = zip(*([leaf for _, leaf in _leaves(batch)] for batch in self.batches))
        joined = iter([_join(list(parts)) for parts in columns])
        return _map(lambda _: next(joined), self.batches[0])


def _join(parts: list[Any]) -> Any:
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else list(itertools.chain(*parts))


def gather(values: Any, device: torch.device, group: Any = None) -> Any:
    """Every rank's `values` (see the module's docstring), in dataset order, on every rank.
    Tensors travel through `device` (the backend's) and come back on the device they were on.
    `group`: the data ranks' (None: every rank), those the evaluation split the samples over."""
    local = values.values() if isinstance(values, Collector) else values
    mine = (None, 0, []) if local is None else (_map(_describe, local), samples(local), _objects(local))
    shared = dist.gather_objects(mine, group)
    skeleton = _reference(shared)
    if skeleton is None:  # nothing anywhere: nothing to rebuild
        return local
    counts = [count for _, count, _ in shared]
    own = local if mine[1] else _map(lambda leaf: _empty(leaf, device), skeleton)
    parts = iter(_gather_leaves(own, shared, device, group))
    return _map(lambda _: _interleave(next(parts), sum(counts)), skeleton)


def _objects(values: Any) -> list[list[Any]]:
    return [leaf for _, leaf in _leaves(values) if isinstance(leaf, list)]


def _empty(leaf: _Leaf, device: torch.device) -> Any:
    """A rank's share of no samples, shaped like the others'."""
    return [] if leaf.kind == "objects" else torch.empty((0, *leaf.shape), dtype=leaf.dtype, device=device)


def _reference(shared: list[tuple[Any, int, list]]) -> Any:
    """Rank 0's structure, once every rank's count is checked against the strided layout and
    the structure of every rank with samples against rank 0's (on every rank alike, so all
    raise together rather than some waiting in a collective)."""
    counts = [count for _, count, _ in shared]
    world, total = len(counts), sum(counts)
    expected = [len(range(r, total, world)) for r in range(world)]
    if counts != expected:
        raise UsageError(
            f"rt.gather: the ranks passed {counts} samples, but an evaluation pass over {total} samples "
            f"gives them {expected}: each rank must pass its values for its whole rt.eval_loader share, "
            "in the loader's order"
        )
    if shared[0][0] is None:
        return None
    ref = list(_leaves(shared[0][0]))
    for rank, (skeleton, count, _) in enumerate(shared):
        if count and list(_leaves(skeleton)) != ref:
            theirs = ", ".join(f"{p}: {leaf}" for p, leaf in _leaves(skeleton))
            ours = ", ".join(f"{p}: {leaf}" for p, leaf in ref)
            raise UsageError(f"rt.gather: rank {rank} passed {{{theirs}}}, rank 0 {{{ours}}}")
    return shared[0][0]


def _gather_leaves(
    own: Any, shared: list[tuple[Any, int, list]], device: torch.device, group: Any
) -> Iterator[list[Any]]:
    """Each leaf's parts from every rank, in rank order."""
    objects = 0
    for _, leaf in _leaves(own):
        if isinstance(leaf, list):
            yield [theirs[objects] if count else [] for _, count, theirs in shared]
            objects += 1
        else:
            parts = dist.all_gather(leaf.detach().to(device), group)
            yield [part.to(leaf.device) for part in parts]


def _interleave(parts: list[Any], total: int) -> Any:
    """Sample i is value i // W of rank i % W (W = len(parts))."""
    if isinstance(parts[0], torch.Tensor):
        out = parts[0].new_empty((total, *parts[0].shape[1:]))
    else:
        out = [None] * total
    for rank, part in enumerate(parts):
        out[rank :: len(parts)] = part
    return out
