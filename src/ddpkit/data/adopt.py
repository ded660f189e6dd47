"""A DataLoader the user built, read into ddpkit's terms, so `rt.loader(dataloader)` keeps the
user's dataset, collate and worker settings and ddpkit's promises: a global batch, one global
order whatever the number of processes, exact evaluation, a resumable position.

What is read, and how:

- `batch_size` is the GLOBAL batch, the samples of one optimizer step over all processes. A
  DataLoader written for one process gives one step that many samples, so the script trains the
  same on N processes. (Accelerate and Fabric read it per process: their global batch grows with
  the number of processes.)
- the order: a `RandomSampler` (shuffle=True) becomes ddpkit's seeded shuffle, a
  `SequentialSampler` (shuffle=False) the dataset's order; an IterableDataset is read as one
  stream (`StreamLoader`), in its own order. Any other sampler or batch sampler
  would decide which samples each process reads, which is what ddpkit does itself: refused,
  with the line saying what to do (a `DistributedSampler` is simply dropped by the user).
- `drop_last`, `collate_fn`, `num_workers`, `persistent_workers`, `prefetch_factor`,
  `timeout`, `worker_init_fn` (run after ddpkit's own worker seeding) and
  `multiprocessing_context` are kept. Not kept: the loader's `generator` (worker seeds come
  from ddpkit's per-rank generator) and `pin_memory` (ddpkit pins on CUDA, not on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from ..core import checks
from ..errors import UsageError

# DataLoader settings carried over as they are (the sampler, batch size and order are ddpkit's).
KEPT = ("timeout", "worker_init_fn", "multiprocessing_context")


@dataclass(frozen=True)
class Adopted:
    """What `rt.loader` takes from a user's DataLoader."""

    dataset: Any
    batch_size: int
    shuffle: bool | None  # None: not said (a Dataset: shuffled; a stream: its own order)
    drop_last: bool
    collate_fn: Any = None  # None: default_collate
    options: dict[str, Any] = field(default_factory=dict)  # the DataLoader's other settings


def source(data: Any, batch_size: int | None, shuffle: bool | None, drop_last: bool | None, collate: Any) -> Adopted:
    """What `rt.loader` / `rt.eval_loader` build a loader from: a DataLoader's dataset and
    settings, read by `adopt`, with the arguments given (not None) winning; or a Dataset's or
    an IterableDataset's, with the defaults. Bad arguments are a UsageError."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise UsageError(f"batch_size must be a whole number of samples >= 1, got {checks.shown(batch_size)}")
    if collate is not None and not callable(collate):
        raise UsageError(f"collate_fn must be a function of a list of samples, not {type(collate).__name__}")
    if isinstance(data, DataLoader):
        src = adopt(data, batch_size)
        overrides = {"shuffle": shuffle, "drop_last": drop_last, "collate_fn": collate}
        return replace(src, **{k: v for k, v in overrides.items() if v is not None})
    if not isinstance(data, IterableDataset) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise UsageError(
            f"a loader reads a Dataset (len() and [i]), an IterableDataset or a DataLoader, not {type(data).__name__}"
        )
    if batch_size is None:
        raise UsageError("rt.loader(dataset): give batch_size=, the GLOBAL batch (or pass a DataLoader)")
    return Adopted(data, batch_size, shuffle, bool(drop_last), collate)


def adopt(loader: DataLoader, batch_size: int | None = None) -> Adopted:
    """Read `loader` (see the module's docstring); `batch_size` overrides the loader's."""
    batch_size = batch_size if batch_size is not None else _batch_size(loader)
    return Adopted(
        dataset=loader.dataset,
        batch_size=batch_size,
        shuffle=_shuffled(loader),
        drop_last=loader.drop_last,
        collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
        options=_options(loader),
    )


def _batch_size(loader: DataLoader) -> int:
    if loader.batch_size is None:
        raise UsageError(
            "rt.loader(DataLoader): it has no batch_size (a batch_sampler, or batch_size=None); "
            "give rt.loader(..., batch_size=GLOBAL) and build the DataLoader with neither"
        )
    return loader.batch_size


def _shuffled(loader: DataLoader) -> bool | None:
    """True for a plain RandomSampler, False for a SequentialSampler, None for a stream (an
    IterableDataset: no sampler of the user's); refused otherwise."""
    if isinstance(loader.dataset, IterableDataset):
        return None
    if type(loader.batch_sampler) is not BatchSampler:
        raise UsageError(
            f"rt.loader(DataLoader): its batch_sampler {type(loader.batch_sampler).__name__} would decide the "
            "batches, which ddpkit does (the global batch, split over the processes); build the DataLoader "
            "with batch_size= and shuffle= instead"
        )
    sampler = loader.sampler
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return True
    if type(sampler) is SequentialSampler:
        return False
    raise UsageError(
        f"rt.loader(DataLoader): its sampler {type(sampler).__name__} would decide which samples each "
        "process reads, which ddpkit does itself; build the DataLoader with shuffle=True or False and no "
        "sampler (drop a DistributedSampler: ddpkit splits every global batch over the processes)"
    )


def _options(loader: DataLoader) -> dict[str, Any]:
    options = {name: getattr(loader, name) for name in KEPT}
    options["num_workers"] = loader.num_workers
    if loader.num_workers > 0:  # DataLoader refuses these two without workers
        options["persistent_workers"] = loader.persistent_workers
        options["prefetch_factor"] = loader.prefetch_factor
    return options
