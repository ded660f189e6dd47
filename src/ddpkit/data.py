"""Datasets, samplers and the distributed loader.

- `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images), the offline default.
  Split fixed once for all runs: a permutation drawn with NumPy's PCG64 seeded 0 puts 1438
  images in train and 359 in test, whatever `--seed` is.
- `synthetic`: class templates plus noise, any shape, for speed tests that still learn.

Training batches come from `GlobalBatchSampler`: one global order per epoch, cut into global
batches, each split over the ranks, so step k sees the same samples on any number of processes.
Evaluation uses `ShardSampler`, which splits the test set over ranks without padding, so every
test sample is counted exactly once whatever the world size.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from .launcher import cpu_count
from .tree import map_tensors

DATASETS = ("digits", "synthetic")
DIGITS_TEST_SIZE = 359


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    in_shape: tuple[int, ...]
    num_classes: int


def _digits_array() -> np.ndarray:
    # Read scikit-learn's bundled CSV directly: importing sklearn.datasets takes over a second
    # (it pulls in SciPy), reading the file takes milliseconds. Same data as load_digits().
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):  # a future layout: fall back to the public API
        from sklearn.datasets import load_digits

        d = load_digits()
        return np.concatenate([d.data, d.target[:, None]], axis=1)
    return np.loadtxt(path, delimiter=",", dtype=np.float32)


def digits() -> Splits:
    table = _digits_array()
    order = np.random.default_rng(0).permutation(len(table))
    test_idx, train_idx = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    x = torch.from_numpy(table[:, :64].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return Splits(
        TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx]), (1, 8, 8), 10
    )


def synthetic(shape: tuple[int, ...], size: int, num_classes: int, seed: int = 0) -> Splits:
    """`size` training and `size // 5` test samples: a random template per class plus noise.

    Drawn from a generator seeded with `seed`, so every rank builds the same tensors.
    """
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn((num_classes, *shape), generator=g)
    n_test = max(1, size // 5)
    y = torch.randint(0, num_classes, (size + n_test,), generator=g)
    x = templates[y] + 1.5 * torch.randn((size + n_test, *shape), generator=g)
    return Splits(
        TensorDataset(x[:size], y[:size]), TensorDataset(x[size:], y[size:]), tuple(shape), num_classes
    )


def shape_of(name: str, synthetic_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset without loading it."""
    return ((1, 8, 8), 10) if name == "digits" else (tuple(synthetic_shape), num_classes)


def load(name: str, *, synthetic_shape: tuple[int, ...] = (3, 32, 32), synthetic_size: int = 4096,
         num_classes: int = 10, seed: int = 0) -> Splits:
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic(synthetic_shape, synthetic_size, num_classes, seed)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


class ShardSampler(Sampler[int]):
    """Indices rank, rank+world, rank+2*world, ... of the dataset, in order, with no padding.

    Ranks may get one sample more or less than each other; that is what makes evaluation exact
    (DistributedSampler instead repeats samples to even out the shards).
    """

    def __init__(self, length: int, world_size: int, rank: int):
        self.length, self.world_size, self.rank = length, world_size, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def check_global_batch(global_batch: int, world_size: int) -> None:
    """A global batch needs at least one sample per process; it need not divide evenly."""
    if global_batch < world_size:
        raise ValueError(
            f"--batch-size {global_batch} is smaller than the {world_size} processes; "
            f"the global batch needs at least one sample per process"
        )


def share(batch_len: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, length) of `rank`'s contiguous slice of a global batch of `batch_len` samples:
    the first `batch_len % world_size` ranks take one sample more."""
    base, extra = divmod(batch_len, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class MicroBatch:
    """What the runtime needs to know about the micro-batch a loader just handed out."""

    size: int  # samples in it, on this rank
    step_size: int  # samples in the whole global batch (all ranks, all micro-batches)
    last: bool  # the last micro-batch of this rank for this optimizer step


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches, cut from one global order that ignores the world size.

    Epoch e's order is a permutation drawn from `seed + e`. Global batch k is samples
    [k*B, (k+1)*B) of it; each rank takes a contiguous slice (shares differ by at most one
    when B does not divide evenly) and splits it into micro-batches of at most
    `micro_batch_size`. So which samples form step k depends on the seed and the epoch only,
    and a run can stop after any step and continue on any number of processes.
    """

    def __init__(self, length: int, global_batch: int, world_size: int, rank: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, micro_batch_size: int | None = None):
        check_global_batch(global_batch, world_size)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        self.length, self.global_batch, self.world_size, self.rank = length, global_batch, world_size, rank
        self.shuffle, self.seed, self.drop_last, self.micro = shuffle, seed, drop_last, micro_batch_size
        self.epoch, self.start_step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.length, self.global_batch)
        return full + (rest > 0 and not self.drop_last)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.length)
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def plan(self) -> Iterator[tuple[list[int], MicroBatch]]:
        """(indices, MicroBatch) for this rank's remaining micro-batches of the epoch."""
        order = self.order()
        for step in range(self.start_step, self.steps_per_epoch):
            batch = order[step * self.global_batch:(step + 1) * self.global_batch]
            offset, size = share(len(batch), self.world_size, self.rank)
            mine = batch[offset:offset + size].tolist()
            micro = self.micro or max(1, size)
            # A rank whose share is empty (a last batch smaller than the world) still takes
            # one empty micro-batch: DDP needs every rank's backward to all-reduce.
            chunks = [mine[i:i + micro] for i in range(0, size, micro)] or [[]]
            for i, chunk in enumerate(chunks):
                yield chunk, MicroBatch(len(chunk), len(batch), i == len(chunks) - 1)

    def __iter__(self) -> Iterator[list[int]]:
        return (indices for indices, _ in self.plan())

    def __len__(self) -> int:
        return sum(1 for _ in self.plan())


class _Collate:
    """default_collate that also turns an empty index list into an empty batch of the right
    shape (taken from sample 0), for ranks whose share of a small last batch is empty."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return default_collate(samples)
        return map_tensors(lambda t: t[:0], default_collate([self.dataset[0]]))


def move(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to `device`, asynchronously from pinned memory on CUDA."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


class DistributedLoader:
    """Batches on the device, one epoch per pass, resumable at any optimizer step.

    `epoch` is the epoch being (or next to be) read and `position` the optimizer steps of it
    already handed out. A pass left early continues where it stopped; a finished pass moves
    to the next epoch. `state_dict()` holds both, so a resumed run, on any number of
    processes when the sampler is a GlobalBatchSampler, reads exactly the batches not yet read.
    `current` describes the micro-batch last handed out (None for evaluation loaders).
    """

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader, self.device = loader, device
        self.epoch = self.position = 0
        self.current: MicroBatch | None = None
        self.on_batch: Any = None  # set by the Runtime: told of every training micro-batch

    @property
    def sampler(self) -> Any:
        return self.loader.batch_sampler if isinstance(self.loader.batch_sampler, GlobalBatchSampler) \
            else self.loader.sampler

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def steps_per_epoch(self) -> int:
        return getattr(self.sampler, "steps_per_epoch", len(self.loader))

    def __len__(self) -> int:
        """Micro-batches the next pass yields (fewer when resuming inside an epoch)."""
        if isinstance(self.sampler, GlobalBatchSampler):
            self.sampler.set_epoch(self.epoch, self.position)
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if not isinstance(sampler, GlobalBatchSampler):  # evaluation: a fixed shard
            for batch in self.loader:
                yield move(batch, self.device)
            return
        sampler.set_epoch(self.epoch, self.position)
        plan = (info for _, info in sampler.plan())
        try:
            for batch, info in zip(self.loader, plan):
                self.current = info
                if info.last:
                    self.position += 1  # handed out, so a checkpoint after this step skips it
                if self.on_batch is not None:
                    self.on_batch(self)
                yield move(batch, self.device)
            self.epoch, self.position = self.epoch + 1, 0
        finally:
            # The pass ended, or was left early: no micro-batch is current any more.
            self.current = None
            if self.on_batch is not None:
                self.on_batch(self)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state.get("position", 0))


def loader_options(dataset: Dataset, device: torch.device, num_workers: int | None,
                   local_world_size: int) -> dict[str, Any]:
    """DataLoader options: pinned memory on CUDA; worker processes (persisting across epochs)
    only where loading does work: on CUDA, for datasets that are not tensors already in memory."""
    if num_workers is None:
        in_memory = isinstance(dataset, TensorDataset)
        cores = cpu_count() // max(1, local_world_size)
        num_workers = 0 if in_memory or device.type != "cuda" else min(4, max(1, cores - 1))
    return {
        "num_workers": num_workers,
        "pin_memory": device.type == "cuda",
        "persistent_workers": num_workers > 0,
    }


def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: NumPy and `random` seeded from the worker's torch seed, which
    the DataLoader derives from the loader's generator (per rank) and the worker id. Without
    this every worker would share the parent's NumPy state and repeat the same augmentations."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def train_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, micro_batch_size: int | None = None,
                 num_workers: int | None = None, local_world_size: int = 1) -> DistributedLoader:
    sampler = GlobalBatchSampler(len(dataset), global_batch, world_size, rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last, micro_batch_size=micro_batch_size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # per-rank worker seeds
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=_Collate(dataset), worker_init_fn=seed_worker,
                        generator=generator, **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(loader, device)


def eval_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                num_workers: int | None = None, local_world_size: int = 1) -> DistributedLoader:
    sampler = ShardSampler(len(dataset), world_size, rank)
    batch = max(1, math.ceil(global_batch / world_size))
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler,
                        **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(loader, device)
