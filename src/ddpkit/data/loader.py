"""The distributed loader: batches on the device, one epoch per pass, resumable at any
optimizer step.

Two ways to turn a sampler's indices into batches, with the same samples in the same order:

- resident (the default for in-memory datasets): the whole dataset, as stored (uint8 images),
  sits on the device once; a batch is one index gather, then batched augmentation and
  normalization on the device. No per-sample Python, no collate, no host-to-device copy.
- a DataLoader (for datasets that are not tensors in memory): per-sample `__getitem__` in
  worker processes, pinned memory and non-blocking copies on CUDA.

A dataset with a `token_counts` attribute (one count per sample: `TextSet`, or a user's) has
losses that are means over tokens: its training micro-batches say how many tokens they hold
and their global batch holds (`MicroBatch.tokens`), which the runtime weighs them by.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..core.device import cpu_count
from ..core.seed import SeedWorker, loader_generator
from ..core.tree import empty_like_batch, map_tensors
from ..errors import UsageError
from .images import ImageSet, augment_keys, selectable
from .samplers import GlobalBatchSampler, MicroBatch, ShardSampler
from .text import TextSet


class _Collate:
    """The collate function (default_collate unless the user gave one) that also turns an empty
    index list into an empty batch of the right shape (sample 0's, cut to no rows), for ranks
    whose share of a small last batch is empty."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any] | None = None):
        self.dataset, self.collate = dataset, collate_fn or default_collate

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate(samples)
        return empty_like_batch(self.collate([self.dataset[0]]))


def move(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Move the tensors of a (nested) batch to `device`, asynchronously from pinned memory on CUDA;
    4-D float batches (images) in channels-last layout if asked."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=True)
        if channels_last and t.dim() == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    return map_tensors(one, batch)


class Resident:
    """A dataset held whole on the device: batches are index gathers there (plus, for an
    ImageSet, batched augmentation and normalization; for a TextSet, the cutting and padding
    of its sequences). Works for ImageSet, TextSet and TensorDataset."""

    def __init__(self, dataset: Dataset, device: torch.device, channels_last: bool = False):
        self.channels_last = channels_last
        self.images: ImageSet | None = dataset.to(device) if isinstance(dataset, ImageSet) else None
        self.text: TextSet | None = dataset.to(device) if isinstance(dataset, TextSet) else None
        self.tensors: tuple[torch.Tensor, ...] = ()
        if isinstance(dataset, TensorDataset):
            self.tensors = tuple(t.to(device) for t in dataset.tensors)
        self.select = [selectable(t) for t in self.tensors]  # gathered with index_select, not t[i]
        self.device = device

    @staticmethod
    def supports(dataset: Any) -> bool:
        return isinstance(dataset, (ImageSet, TextSet, TensorDataset))

    def cutter(self, order: torch.Tensor, seed: int, epoch: int) -> Callable[[int, int], Any]:
        """The function a training pass calls once per micro-batch: the batch of positions
        [start, stop) of the epoch's `order` (augmented with keys from `seed` and `epoch`)."""
        if self.tensors and not self.channels_last:  # nothing but the gather: no checks per step
            return tensor_cut(self.tensors, order, all(self.select))
        augment = self.images is not None and self.images.augment is not None

        def cut(start: int, stop: int) -> Any:
            keys = augment_keys(seed, epoch, torch.arange(start, stop, device=self.device)) if augment else None
            return self.batch(order[start:stop], keys)

        return cut

    def batch(self, indices: torch.Tensor, keys: torch.Tensor | None = None) -> Any:
        if self.images is not None:
            batch = list(self.images.batch(indices, keys))
        elif self.text is not None:
            batch = list(self.text.batch(indices))
        else:
            batch = [t.index_select(0, indices) if ok else t[indices] for t, ok in zip(self.tensors, self.select)]
        if self.channels_last:
            batch = [
                t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t
                for t in batch
            ]
        return batch


class DistributedLoader:
    """Batches on the device, one epoch per pass, resumable at any optimizer step.

    `epoch` is the epoch being (or next to be) read and `position` the optimizer steps of it
    already handed out. A pass left early continues where it stopped; a finished pass moves
    to the next epoch. `state_dict()` holds both, so a resumed run, on any number of
    processes when the sampler is a GlobalBatchSampler, reads exactly the batches not yet read.
    `current` describes the micro-batch last handed out (None for evaluation loaders).

    Batches come from `resident` (the dataset on the device) when given, else from `loader`
    (a DataLoader over the sampler); both yield the same samples in the same order.
    """

    # The process group of the ranks its sampler splits the samples over (None: every rank);
    # a Runtime sets it where tensor-parallel ranks share their samples (ddpkit.strategy.mesh).
    group: Any = None

    def __init__(
        self,
        dataset: Dataset,
        sampler: Any,
        device: torch.device,
        loader: DataLoader | None = None,
        resident: Resident | None = None,
        channels_last: bool = False,
    ):
        self.dataset, self._sampler, self.device, self.loader, self.resident = (
            dataset,
            sampler,
            device,
            loader,
            resident,
        )
        self.channels_last = channels_last
        self.epoch = self.position = 0
        self._ended_by_state = False  # loaded at an epoch's last step (see __iter__)
        self.current: MicroBatch | None = None
        self.on_batch: Any = None  # set by the Runtime: told of every training micro-batch
        # The Runtime's Accumulation, whose `on_batch` that is: what it holds (`micro`) lets the
        # resident pass skip telling it a micro-batch it holds already (see _resident_pass).
        self.accumulation: Any = None

    @property
    def sampler(self) -> Any:
        return self._sampler

    @property
    def generator(self) -> torch.Generator | None:
        """The generator that seeds DataLoader workers (None on the resident path)."""
        return self.loader.generator if self.loader is not None else None

    @property
    def steps_per_epoch(self) -> int:
        return getattr(self.sampler, "steps_per_epoch", None) or len(self)

    def __len__(self) -> int:
        """Micro-batches the next pass yields (fewer when resuming inside an epoch)."""
        if isinstance(self.sampler, GlobalBatchSampler):
            self.sampler.set_epoch(self.epoch, self.position)
            return len(self.sampler)
        return len(self.loader) if self.loader is not None else len(self.sampler.chunks())

    def __iter__(self) -> Iterator[Any]:
        if not isinstance(self.sampler, GlobalBatchSampler):  # evaluation: a fixed shard
            return self._eval_batches()
        return self._resident_pass() if self.resident is not None else self._loader_pass()

    def _begin_pass(self) -> bool:
        """Move to the pass's epoch and position; False when the pass is empty."""
        if self.position >= self.sampler.steps_per_epoch:  # every step of it was handed out already
            self.epoch, self.position = self.epoch + 1, 0
            if self._ended_by_state:
                # Loaded from a checkpoint of the epoch's last step: this pass is what is left
                # of that epoch, which is nothing (not a pass over the next epoch).
                self._ended_by_state = False
                return False
        self._ended_by_state = False
        self.sampler.set_epoch(self.epoch, self.position)
        return True

    def _end_pass(self) -> None:
        """The pass ended, or was left early: no micro-batch is current any more."""
        self.current = None
        if self.on_batch is not None:
            self.on_batch(self)

    def _loader_pass(self) -> Iterator[Any]:
        if not self._begin_pass():
            return
        try:
            plan = (info for _, _, info in self.sampler.spans())
            batches = ((move(batch, self.device, self.channels_last), info) for batch, info in zip(self.loader, plan))
            yield from hand_out(self, batches)
            self.epoch, self.position = self.epoch + 1, 0
        finally:
            self._end_pass()

    def _resident_pass(self) -> Iterator[Any]:
        """A pass over the resident batches, with `hand_out`'s work written out in the same
        generator: this loop runs once per step, and each generator layer, call or object it
        saves is time the hand-written loop does not spend (`python -m benchmarks overhead`)."""
        if not self._begin_pass():
            return
        sampler, on_batch, acc = self.sampler, self.on_batch, self.accumulation
        try:
            # One permutation per epoch on the device; each micro-batch is a slice of it.
            cut = self.resident.cutter(sampler.order().to(self.device), sampler.seed, sampler.epoch)
            for start, stop, info in sampler.spans():
                self.current = info
                if info.last:
                    self.position += 1
                # Full global batches share one MicroBatch: a step's last one that the runtime's
                # accumulation holds already (this loader told it last step, and nobody told it
                # anything since) would be told again to no effect, so it is not.
                if on_batch is not None and (acc is None or info is not acc.micro or not info.last):
                    on_batch(self)
                yield cut(start, stop)
            self.epoch, self.position = self.epoch + 1, 0
        finally:
            self._end_pass()

    def _eval_batches(self) -> Iterator[Any]:
        if self.resident is None:
            for batch in self.loader:
                yield move(batch, self.device, self.channels_last)
            return
        for start, stop, step in self.sampler.chunks():
            yield self.resident.batch(torch.arange(start, stop, step, device=self.device))

    def empty_batch(self) -> Any:
        """A batch of no samples, shaped like this loader's (for forwards a rank runs only to
        keep in step with the others: fsdp's evaluation)."""
        if self.resident is not None:
            return self.resident.batch(torch.zeros(0, dtype=torch.long, device=self.device))
        collate = self.loader.collate_fn if self.loader is not None else _Collate(self.dataset)
        return move(collate([]), self.device, self.channels_last)  # the user's collate's shape

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state.get("position", 0))
        self._ended_by_state = self.position >= self.steps_per_epoch


def tensor_cut(
    tensors: tuple[torch.Tensor, ...], order: torch.Tensor, select: bool
) -> Callable[[int, int], list[torch.Tensor]]:
    """`[t[order[start:stop]] for t in tensors]` as a function of (start, stop), written out
    for one and two tensors (features, labels): a comprehension is a function call of its own,
    once per step (`python -m benchmarks overhead`). With `select` (every tensor `selectable`)
    the rows are gathered with `index_select`, which gives the same tensor as `t[i]` without
    Python's indexing machinery (about 0.7 µs less per tensor on a CPU)."""
    if not select:

        def cut(start: int, stop: int) -> list[torch.Tensor]:
            i = order[start:stop]
            return [t[i] for t in tensors]

    elif len(tensors) == 2:
        a, b = tensors

        def cut(start: int, stop: int) -> list[torch.Tensor]:
            i = order[start:stop]
            return [a.index_select(0, i), b.index_select(0, i)]

    elif len(tensors) == 1:
        (a,) = tensors

        def cut(start: int, stop: int) -> list[torch.Tensor]:
            return [a.index_select(0, order[start:stop])]

    else:

        def cut(start: int, stop: int) -> list[torch.Tensor]:
            i = order[start:stop]
            return [t.index_select(0, i) for t in tensors]

    return cut


def hand_out(loader: Any, batches: Iterator[tuple[Any, MicroBatch]]) -> Iterator[Any]:
    """Yield a training loader's micro-batches, each made `loader.current` and told to the
    runtime (`on_batch`: weighting, the gradient-sync switch) first; a step's last one moves
    `loader.position` on, since it is handed out: a checkpoint after this step skips it."""
    for batch, info in batches:
        loader.current = info
        if info.last:
            loader.position += 1
        if loader.on_batch is not None:
            loader.on_batch(loader)
        yield batch


def loader_options(
    dataset: Dataset,
    device: torch.device,
    num_workers: int | None,
    local_world_size: int,
    chosen: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """DataLoader options: pinned memory on CUDA; worker processes (persisting across epochs)
    only where loading does work: on CUDA, for datasets that are not tensors already in memory.
    `chosen`: the settings of a DataLoader the user built (see `adopt`), which win."""
    chosen = dict(chosen or {})
    num_workers = chosen.pop("num_workers", num_workers)
    if num_workers is None:
        in_memory = isinstance(dataset, (TensorDataset, ImageSet, TextSet))
        cores = cpu_count() // max(1, local_world_size)
        num_workers = 0 if in_memory or device.type != "cuda" else min(4, max(1, cores - 1))
    return {
        "num_workers": num_workers,
        "pin_memory": device.type == "cuda",
        "persistent_workers": num_workers > 0,
        **chosen,
    }


def fits_on(dataset: Dataset, device: torch.device) -> bool:
    """Whether keeping `dataset` whole on `device` is sensible: always in host memory (it is
    there already); on a GPU when it takes under a quarter of the device's memory."""
    if not Resident.supports(dataset):
        return False
    if device.type != "cuda":
        return True
    size = (
        dataset.nbytes()
        if isinstance(dataset, (ImageSet, TextSet))
        else sum(t.numel() * t.element_size() for t in dataset.tensors)
    )
    return size < torch.cuda.get_device_properties(device).total_memory // 4


def _use_resident(
    dataset: Dataset, device: torch.device, resident: bool | None, num_workers: int | None, collate_fn: Any = None
) -> bool:
    if resident is None:  # auto: the device path whenever it can, unless workers or a collate were asked for
        return not num_workers and collate_fn is None and fits_on(dataset, device)
    if resident and not Resident.supports(dataset):
        raise UsageError(
            f"a resident loader needs an ImageSet, TextSet or TensorDataset, not {type(dataset).__name__}; "
            "use the DataLoader path"
        )
    if resident and collate_fn is not None:
        raise UsageError("a resident loader cuts batches on the device and calls no collate_fn; use resident=False")
    return resident


def train_loader(
    dataset: Dataset,
    global_batch: int,
    *,
    world_size: int,
    rank: int,
    device: torch.device,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    micro_batch_size: int | None = None,
    num_workers: int | None = None,
    local_world_size: int = 1,
    resident: bool | None = None,
    channels_last: bool = False,
    lockstep: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    dataloader: dict[str, Any] | None = None,
) -> DistributedLoader:
    """This rank's training loader (see `DistributedLoader`). `collate_fn` turns a micro-batch's
    samples into a batch (default_collate); `dataloader` holds the other settings of a DataLoader
    the user built (`adopt`): workers, pinning, worker_init_fn and the like."""
    sampler = GlobalBatchSampler(
        len(dataset),
        global_batch,
        world_size,
        rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        micro_batch_size=micro_batch_size,
        lockstep=lockstep,
        token_counts=getattr(dataset, "token_counts", None),
    )
    if _use_resident(dataset, device, resident, num_workers, collate_fn):
        return DistributedLoader(dataset, sampler, device, resident=Resident(dataset, device, channels_last))
    sampler.keys = isinstance(dataset, ImageSet) and dataset.augment is not None
    chosen = dict(dataloader or {})
    generator = loader_generator(seed, rank)  # per-rank worker seeds
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=_Collate(dataset, collate_fn),
        worker_init_fn=SeedWorker(chosen.pop("worker_init_fn", None)),
        generator=generator,
        **loader_options(dataset, device, num_workers, local_world_size, chosen),
    )
    return DistributedLoader(dataset, sampler, device, loader=loader, channels_last=channels_last)


def eval_loader(
    dataset: Dataset,
    global_batch: int,
    *,
    world_size: int,
    rank: int,
    device: torch.device,
    num_workers: int | None = None,
    local_world_size: int = 1,
    resident: bool | None = None,
    channels_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    dataloader: dict[str, Any] | None = None,
) -> DistributedLoader:
    """This rank's share of `dataset` for evaluation, in batches of about `global_batch /
    world_size`; `collate_fn` and `dataloader` as for `train_loader`."""
    batch = max(1, math.ceil(global_batch / world_size))
    sampler = ShardSampler(len(dataset), world_size, rank, batch)
    if _use_resident(dataset, device, resident, num_workers, collate_fn):
        return DistributedLoader(
            dataset, sampler, device, resident=Resident(dataset, device, channels_last=channels_last)
        )
    chosen = dict(dataloader or {})
    # Each pass of a DataLoader draws its workers' base seed from its generator, else from the
    # process's torch stream: an evaluation between two steps would move the training's random
    # stream, and a full state saved before it would not resume what followed. Its own
    # generator (seeded by the rank: reproducible) leaves the process's stream alone.
    generator = torch.Generator().manual_seed(rank)  # (`source` never keeps a loader's own)
    loader = DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        collate_fn=_Collate(dataset, collate_fn),
        worker_init_fn=SeedWorker(chosen.pop("worker_init_fn", None)),
        generator=generator,
        **loader_options(dataset, device, num_workers, local_world_size, chosen),
    )
    return DistributedLoader(dataset, sampler, device, loader=loader, channels_last=channels_last)
