"""Datasets, samplers and the distributed loader.

- `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images), the offline default.
  Split fixed once for all runs: a permutation drawn with NumPy's PCG64 seeded 0 puts 1438
  images in train and 359 in test, whatever `--seed` is.
- `synthetic`: class templates plus noise, any shape, for speed tests that still learn.

Training batches come from `DistributedSampler` (the epoch is set for the user). Evaluation
uses `ShardSampler`, which splits the test set over ranks without padding, so every test
sample is counted exactly once whatever the world size.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from .launcher import cpu_count

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


def per_rank_batch(global_batch: int, world_size: int) -> int:
    if global_batch < world_size:
        raise ValueError(
            f"--batch-size {global_batch} is smaller than the {world_size} processes; "
            f"the global batch needs at least one sample per process"
        )
    if global_batch % world_size:
        lower = global_batch - global_batch % world_size
        raise ValueError(
            f"--batch-size {global_batch} does not split evenly over {world_size} processes; "
            f"use a multiple of {world_size} such as {lower} or {lower + world_size}"
        )
    return global_batch // world_size


def move(batch: Any, device: torch.device) -> Any:
    """Move tensors in (nested) tuples, lists and dicts to `device`, asynchronously from pinned
    memory on CUDA."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move(v, device) for k, v in batch.items()}
    return batch


class DistributedLoader:
    """A DataLoader that moves batches to the device and sets the sampler's epoch itself.

    Iterating it once is one epoch; the next iteration reshuffles. `epoch` counts the epochs
    started; `state_dict()` holds it, so a resumed run continues the same shuffle sequence.
    """

    def __init__(self, loader: DataLoader, device: torch.device, epoch: int = 0):
        self.loader, self.device, self.epoch = loader, device, epoch

    @property
    def sampler(self) -> Sampler:
        return self.loader.sampler

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        # Count the epoch when it starts, so leaving the loop early still moves the shuffle on.
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            yield move(batch, self.device)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])


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


def train_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_workers: int | None = None, local_world_size: int = 1) -> DistributedLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=per_rank_batch(global_batch, world_size), sampler=sampler,
                        drop_last=drop_last, **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(loader, device)


def eval_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                num_workers: int | None = None, local_world_size: int = 1) -> DistributedLoader:
    sampler = ShardSampler(len(dataset), world_size, rank)
    batch = max(1, math.ceil(global_batch / world_size))
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler,
                        **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(loader, device)
