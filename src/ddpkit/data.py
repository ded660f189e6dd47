"""Datasets, samplers and the distributed loader.

- `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images), the offline default.
  Split fixed once for all runs: a permutation drawn with NumPy's PCG64 seeded 0 puts 1438
  images in train and 359 in test, whatever `--seed` is.
- `synthetic`: class templates plus noise, any shape, for speed tests that still learn.
- `toy`: the DDP tutorial's two-class problem in 2-D (5 train, 2 test points).
- `mnist`, `fashion-mnist` (IDX files) and `cifar10` (pickled batches): read from
  `--data-dir` (see `download` for the folder and the downloads, `readers` for the formats),
  normalized with each set's published per-channel mean and std.

Training batches come from `GlobalBatchSampler`: one global order per epoch, cut into global
batches, each split over the ranks, so step k sees the same samples on any number of processes.
Evaluation uses `ShardSampler`, which splits the test set over ranks without padding, so every
test sample is counted exactly once whatever the world size.

Two ways to turn indices into batches, with the same samples in the same order:

- resident (the default for in-memory datasets): the whole dataset, as stored (uint8 images),
  sits on the device once; a batch is one index gather, then batched augmentation and
  normalization on the device. No per-sample Python, no collate, no host-to-device copy.
- a DataLoader (for datasets that are not tensors in memory): per-sample `__getitem__` in
  worker processes, pinned memory and non-blocking copies on CUDA.

Random augmentation (crop with padding, horizontal flip) is drawn per sample from a hash of
(seed, epoch, position of the sample in the epoch's global order), not from a random stream.
So it is the same on both paths, on any number of processes, and after a resume mid-epoch.
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

from . import download, readers
from .errors import UsageError
from .launcher import cpu_count
from .tree import map_tensors

DATASETS = ("digits", "synthetic", "toy", "mnist", "fashion-mnist", "cifar10")
# Datasets read from files: (input shape, classes), known without reading them.
FILE_DATASETS = {"mnist": ((1, 28, 28), 10), "fashion-mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10)}
# Per-channel mean and std of each training set in [0, 1] units, the values in common use
# (torchvision's examples); the images stay uint8, so ImageSet gets them times 255.
NORMALIZATION = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
DIGITS_TEST_SIZE = 359


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    in_shape: tuple[int, ...]
    num_classes: int


_M32 = 0xFFFFFFFF


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply rounds) of a Python int, or elementwise of an
    int64 tensor holding values below 2**32 (both give the same numbers). Both multipliers are
    below 2**31, so no product overflows int64 on any device."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x6C8E9CF5) & _M32
    return x ^ (x >> 16)


def augment_keys(seed: int, epoch: int, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sample from (seed, epoch, its position in the epoch's global order):
    what decides the sample's random crop and flip, wherever and whenever it is read."""
    base = _mix32((seed * 1_000_003 + epoch) & _M32)  # a Python int: no copy to the device per batch
    return _mix32(positions.to(torch.int64) ^ base)


@dataclass(frozen=True)
class Augment:
    """Random crop after zero-padding by `crop_padding` pixels (0: no crop), and a random
    horizontal flip: the standard CIFAR-10 training augmentation."""

    crop_padding: int = 0
    flip: bool = False

    NAMES = ("none", "crop", "flip", "crop-flip")

    @classmethod
    def parse(cls, name: str, crop_padding: int = 4) -> "Augment | None":
        if name not in cls.NAMES:
            raise ValueError(f"--augment: unknown value {name!r}; choose from {', '.join(cls.NAMES)}")
        if name == "none":
            return None
        return cls(crop_padding if "crop" in name else 0, "flip" in name)

    def __call__(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Augment a batch (B, C, H, W) on its device; sample i uses keys[i] only."""
        if self.crop_padding:
            p = self.crop_padding
            b, _, h, w = x.shape
            padded = torch.nn.functional.pad(x, (p, p, p, p))
            span = 2 * p + 1
            dx, dy = (keys >> 1) % span, (keys >> 12) % span
            rows = dy[:, None] + torch.arange(h, device=x.device)  # (B, H)
            cols = dx[:, None] + torch.arange(w, device=x.device)  # (B, W)
            picked = padded[torch.arange(b, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
            x = picked.permute(0, 3, 1, 2)  # advanced indexing put the channels last
        if self.flip:
            x = torch.where((keys & 1).bool()[:, None, None, None], x.flip(3), x)
        return x


class ImageSet(Dataset):
    """Images as stored (uint8, or float), normalized per channel when read, and augmented
    when an `augment` is given and the sampler passes keys.

    `dataset[i]` is sample i normalized; `dataset[(i, key)]` is it augmented by `key` (what
    the DataLoader path's batch sampler asks for). `batch(indices, keys)` does the same for a
    whole batch at once on the device the images are on (the resident path).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Any, std: Any,
                 augment: Augment | None = None):
        if images.dim() != 4:
            raise ValueError(f"ImageSet wants images shaped (N, C, H, W), got {tuple(images.shape)}")
        self.images, self.labels, self.augment = images, labels, augment
        channels = images.shape[1]
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, channels, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, channels, 1, 1)
        self._resident: dict[str, "ImageSet"] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        index, aug_key = key if isinstance(key, tuple) else (key, None)
        keys = None if aug_key is None else torch.tensor([aug_key], dtype=torch.int64)
        x, _ = self._batch(torch.tensor([index]), keys)
        return x[0], self.labels[index]

    def batch(self, indices: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(indices, keys)

    def _batch(self, indices: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[indices]
        if self.augment is not None and keys is not None:
            x = self.augment(x, keys)
        x = (x.float() - self.mean) / self.std
        return x.contiguous(), self.labels[indices]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole set normalized, without augmentation: (images, labels)."""
        return self._batch(torch.arange(len(self)), None)

    def nbytes(self) -> int:
        return self.images.numel() * self.images.element_size() + self.labels.numel() * self.labels.element_size()

    def to(self, device: torch.device) -> "ImageSet":
        """A copy living on `device` (made once, then reused)."""
        if self.images.device == device:
            return self
        key = str(device)
        if key not in self._resident:
            self._resident[key] = ImageSet(self.images.to(device), self.labels.to(device), self.mean.to(device),
                                           self.std.to(device), self.augment)
        return self._resident[key]


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
    """The 8x8 digits as stored (integers 0..16, kept as uint8), normalized with the training
    set's mean and standard deviation."""
    table = _digits_array()
    order = np.random.default_rng(0).permutation(len(table))
    test_idx, train_idx = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    x = torch.from_numpy(table[:, :64].astype(np.uint8)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    train = x[train_idx].float()
    mean, std = train.mean().item(), train.std().item()
    return Splits(ImageSet(x[train_idx], y[train_idx], mean, std), ImageSet(x[test_idx], y[test_idx], mean, std),
                  (1, 8, 8), 10)


def synthetic(shape: tuple[int, ...], size: int, num_classes: int, seed: int = 0) -> Splits:
    """`size` training and `size // 5` test samples: a random template per class plus noise.

    Images (C, H, W) are stored as uint8 like real image sets (so they take the same path:
    resident on the device, augmented and normalized per batch); other shapes stay float.
    Drawn from a generator seeded with `seed`, so every rank builds the same tensors.
    """
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn((num_classes, *shape), generator=g)
    n_test = max(1, size // 5)
    y = torch.randint(0, num_classes, (size + n_test,), generator=g)
    if len(shape) != 3:
        x = templates[y] + 1.5 * torch.randn((size + n_test, *shape), generator=g)
        return Splits(TensorDataset(x[:size], y[:size]), TensorDataset(x[size:], y[size:]), tuple(shape), num_classes)
    # Images are made a chunk at a time: a float copy of 50,000 CIFAR-sized images is 600 MB.
    x = torch.empty((size + n_test, *shape), dtype=torch.uint8)
    for start in range(0, len(x), 4096):
        labels = y[start:start + 4096]
        chunk = templates[labels] + 1.5 * torch.randn((len(labels), *shape), generator=g)
        x[start:start + 4096] = (127.5 + 32.0 * chunk).round().clamp(0, 255).to(torch.uint8)
    train = x[:size]
    mean = torch.stack([train[:, c].float().mean() for c in range(shape[0])])
    std = torch.stack([train[:, c].float().std() for c in range(shape[0])])
    return Splits(ImageSet(x[:size], y[:size], mean, std), ImageSet(x[size:], y[size:], mean, std), tuple(shape),
                  num_classes)


def shape_of(name: str, synthetic_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset without loading it."""
    if name in FILE_DATASETS:
        return FILE_DATASETS[name]
    if name == "toy":
        return (2,), 2
    return ((1, 8, 8), 10) if name == "digits" else (tuple(synthetic_shape), num_classes)


def toy() -> Splits:
    """The two-class toy problem of the PyTorch DDP tutorials (S. Raschka's DDP script)."""
    train_x = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    test_x = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    return Splits(TensorDataset(train_x, torch.tensor([0, 0, 0, 1, 1])), TensorDataset(test_x, torch.tensor([0, 1])),
                  (2,), 2)


def _local_files(name: str, folder: str) -> tuple[list[str], list[str]]:
    """(paths found, downloadable files missing) of a file dataset in `folder`. Each IDX file
    may be there gzipped or not; CIFAR-10 as the tar.gz or as the folder it unpacks to."""
    if name == "cifar10":
        extracted = os.path.join(folder, readers.CIFAR_FOLDER)
        if os.path.isdir(extracted):
            return [extracted], []
        candidates = [[f] for f in download.SOURCES[name].files]
    else:  # train images, train labels, test images, test labels
        candidates = [[f, f[:-len(".gz")]] for f in download.SOURCES[name].files]
    found, missing = [], []
    for names in candidates:
        paths = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
        found.extend(paths[:1])
        missing.extend([] if paths else names[:1])
    return found, missing


def prepare(name: str, data_dir: str | None = None) -> None:
    """Download what dataset `name` lacks into its folder, then check that it reads. Called
    once by `ddpkit train` before workers start, so they only read (`load`)."""
    if name not in FILE_DATASETS:
        return
    folder = download.dataset_dir(name, data_dir)
    _, missing = _local_files(name, folder)
    if missing:
        download.fetch(name, folder, missing)
    load(name, data_dir=data_dir)


# What this process has read (as tensors), by the files' identity: the check in `prepare` is
# then also the read of an in-process run, and forked workers inherit it instead of reading
# the files again. Each load still makes its own ImageSets (they carry augmentation settings
# and device copies that must not outlive a run).
_READ: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _read_files(name: str, data_dir: str | None) -> Splits:
    folder = download.dataset_dir(name, data_dir)
    paths, missing = _local_files(name, folder)
    if missing:
        raise UsageError(f"dataset {name}: {', '.join(missing)} not in {folder}: place them there (from "
                         f"{download.urls(name)[0]}), let `ddpkit train` download them, or pass --data-dir")
    key = (name, *((p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths))
    if key not in _READ:
        _READ.clear()  # one dataset at a time: a process that switches does not keep both
        _READ[key] = _parse_files(name, paths)
    train_x, train_y, test_x, test_y = _READ[key]
    mean, std = (torch.tensor(v) * 255 for v in NORMALIZATION[name])
    return Splits(ImageSet(train_x, train_y, mean, std), ImageSet(test_x, test_y, mean, std),
                  FILE_DATASETS[name][0], FILE_DATASETS[name][1])


def _parse_files(name: str, paths: list[str]) -> tuple[torch.Tensor, ...]:
    if name == "cifar10":
        train_x, train_y, test_x, test_y = readers.read_cifar10(paths[0])
    else:
        train_x, train_y = readers.read_idx_pair(paths[0], paths[1])
        test_x, test_y = readers.read_idx_pair(paths[2], paths[3])
    shape = FILE_DATASETS[name][0]
    for path, x in ((paths[0], train_x), (paths[-1], test_x)):
        if tuple(x.shape[1:]) != shape:
            raise UsageError(f"{path}: images of shape {tuple(x.shape[1:])}, expected {shape} for dataset {name}")
    return (torch.from_numpy(train_x.copy()), torch.from_numpy(train_y), torch.from_numpy(test_x.copy()),
            torch.from_numpy(test_y))


def load(name: str, *, data_dir: str | None = None, synthetic_shape: tuple[int, ...] = (3, 32, 32),
         synthetic_size: int = 4096, num_classes: int = 10, seed: int = 0) -> Splits:
    """Dataset `name`. File datasets are read, never downloaded, here (see `prepare`)."""
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic(synthetic_shape, synthetic_size, num_classes, seed)
    if name == "toy":
        return toy()
    if name in FILE_DATASETS:
        return _read_files(name, data_dir)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


class ShardSampler(Sampler[int]):
    """Indices rank, rank+world, rank+2*world, ... of the dataset, in order, with no padding.

    Ranks may get one sample more or less than each other; that is what makes evaluation exact
    (DistributedSampler instead repeats samples to even out the shards).
    """

    def __init__(self, length: int, world_size: int, rank: int, batch: int = 1):
        self.length, self.world_size, self.rank, self.batch = length, world_size, rank, batch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))

    def chunks(self, batch: int | None = None) -> list[tuple[int, int, int]]:
        """This rank's indices in batches of `batch` (default: the batch it was made with), as
        (start, stop, step) ranges."""
        batch = batch or self.batch
        stride = self.world_size * batch
        return [(s, min(s + stride, self.length), self.world_size) for s in range(self.rank, self.length, stride)]


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
        self.keys = False  # yield (index, augmentation key) pairs instead of indices

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

    def spans(self) -> Iterator[tuple[int, int, MicroBatch]]:
        """(start, stop, MicroBatch): this rank's remaining micro-batches of the epoch, as
        positions [start, stop) in the epoch's global order."""
        for step in range(self.start_step, self.steps_per_epoch):
            first = step * self.global_batch
            batch_len = min(self.global_batch, self.length - first)
            offset, size = share(batch_len, self.world_size, self.rank)
            micro = self.micro or max(1, size)
            # A rank whose share is empty (a last batch smaller than the world) still takes
            # one empty micro-batch: DDP needs every rank's backward to all-reduce.
            starts = list(range(first + offset, first + offset + size, micro)) or [first + offset]
            for i, start in enumerate(starts):
                stop = min(start + micro, first + offset + size)
                yield start, stop, MicroBatch(stop - start, batch_len, i == len(starts) - 1)

    def plan(self) -> Iterator[tuple[list[int], MicroBatch]]:
        """(indices, MicroBatch) for this rank's remaining micro-batches of the epoch."""
        order = self.order()
        for start, stop, info in self.spans():
            yield order[start:stop].tolist(), info

    def __iter__(self) -> Iterator[list[Any]]:
        if not self.keys:
            return (indices for indices, _ in self.plan())
        return self._keyed()

    def _keyed(self) -> Iterator[list[tuple[int, int]]]:
        # (index, augmentation key) pairs, for a dataset that augments per sample (ImageSet).
        order = self.order()
        for start, stop, _ in self.spans():
            keys = augment_keys(self.seed, self.epoch, torch.arange(start, stop))
            yield list(zip(order[start:stop].tolist(), keys.tolist()))

    def __len__(self) -> int:
        return sum(1 for _ in self.spans())


class _Collate:
    """default_collate that also turns an empty index list into an empty batch of the right
    shape (taken from sample 0), for ranks whose share of a small last batch is empty."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return default_collate(samples)
        return map_tensors(lambda t: t[:0], default_collate([self.dataset[0]]))


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
    ImageSet, batched augmentation and normalization). Works for ImageSet and TensorDataset."""

    def __init__(self, dataset: Dataset, device: torch.device, channels_last: bool = False):
        self.channels_last = channels_last
        if isinstance(dataset, ImageSet):
            self.images: ImageSet | None = dataset.to(device)
            self.tensors: tuple[torch.Tensor, ...] = ()
        else:
            self.images = None
            self.tensors = tuple(t.to(device) for t in dataset.tensors)
        self.device = device

    @staticmethod
    def supports(dataset: Any) -> bool:
        return isinstance(dataset, (ImageSet, TensorDataset))

    def batch(self, indices: torch.Tensor, keys: torch.Tensor | None = None) -> Any:
        if self.images is not None:
            batch = list(self.images.batch(indices, keys))
        else:
            batch = [t[indices] for t in self.tensors]
        if self.channels_last:
            batch = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t
                     for t in batch]
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

    def __init__(self, dataset: Dataset, sampler: Any, device: torch.device, loader: DataLoader | None = None,
                 resident: Resident | None = None, channels_last: bool = False):
        self.dataset, self._sampler, self.device, self.loader, self.resident = dataset, sampler, device, loader, resident
        self.channels_last = channels_last
        self.epoch = self.position = 0
        self.current: MicroBatch | None = None
        self.on_batch: Any = None  # set by the Runtime: told of every training micro-batch

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
        sampler = self.sampler
        if not isinstance(sampler, GlobalBatchSampler):  # evaluation: a fixed shard
            yield from self._eval_batches()
            return
        if self.position >= sampler.steps_per_epoch:  # every step of it was handed out already
            self.epoch, self.position = self.epoch + 1, 0
        sampler.set_epoch(self.epoch, self.position)
        try:
            for batch, info in self._train_batches(sampler):
                self.current = info
                if info.last:
                    self.position += 1  # handed out, so a checkpoint after this step skips it
                if self.on_batch is not None:
                    self.on_batch(self)
                yield batch
            self.epoch, self.position = self.epoch + 1, 0
        finally:
            # The pass ended, or was left early: no micro-batch is current any more.
            self.current = None
            if self.on_batch is not None:
                self.on_batch(self)

    def _train_batches(self, sampler: "GlobalBatchSampler") -> Iterator[tuple[Any, MicroBatch]]:
        if self.resident is None:
            plan = (info for _, _, info in sampler.spans())
            for batch, info in zip(self.loader, plan):
                yield move(batch, self.device, self.channels_last), info
            return
        # One permutation per epoch on the device; each micro-batch is a slice of it.
        order = sampler.order().to(self.device)
        augment = self.resident.images is not None and self.resident.images.augment is not None
        for start, stop, info in sampler.spans():
            keys = None
            if augment:
                keys = augment_keys(sampler.seed, sampler.epoch, torch.arange(start, stop, device=self.device))
            yield self.resident.batch(order[start:stop], keys), info

    def _eval_batches(self) -> Iterator[Any]:
        if self.resident is None:
            for batch in self.loader:
                yield move(batch, self.device, self.channels_last)
            return
        for start, stop, step in self.sampler.chunks():
            yield self.resident.batch(torch.arange(start, stop, step, device=self.device))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state.get("position", 0))


def loader_options(dataset: Dataset, device: torch.device, num_workers: int | None,
                   local_world_size: int) -> dict[str, Any]:
    """DataLoader options: pinned memory on CUDA; worker processes (persisting across epochs)
    only where loading does work: on CUDA, for datasets that are not tensors already in memory."""
    if num_workers is None:
        in_memory = isinstance(dataset, (TensorDataset, ImageSet))
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


def fits_on(dataset: Dataset, device: torch.device) -> bool:
    """Whether keeping `dataset` whole on `device` is sensible: always in host memory (it is
    there already); on a GPU when it takes under a quarter of the device's memory."""
    if not Resident.supports(dataset):
        return False
    if device.type != "cuda":
        return True
    size = dataset.nbytes() if isinstance(dataset, ImageSet) else sum(t.numel() * t.element_size() for t in dataset.tensors)
    return size < torch.cuda.get_device_properties(device).total_memory // 4


def _use_resident(dataset: Dataset, device: torch.device, resident: bool | None, num_workers: int | None) -> bool:
    if resident is None:  # auto: the device path whenever it can, unless workers were asked for
        return not num_workers and fits_on(dataset, device)
    if resident and not Resident.supports(dataset):
        raise ValueError(f"a resident loader needs an ImageSet or TensorDataset, not {type(dataset).__name__}; "
                         "use the DataLoader path")
    return resident


def train_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, micro_batch_size: int | None = None,
                 num_workers: int | None = None, local_world_size: int = 1, resident: bool | None = None,
                 channels_last: bool = False) -> DistributedLoader:
    sampler = GlobalBatchSampler(len(dataset), global_batch, world_size, rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last, micro_batch_size=micro_batch_size)
    if _use_resident(dataset, device, resident, num_workers):
        return DistributedLoader(dataset, sampler, device, resident=Resident(dataset, device, channels_last))
    sampler.keys = isinstance(dataset, ImageSet) and dataset.augment is not None
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)  # per-rank worker seeds
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=_Collate(dataset), worker_init_fn=seed_worker,
                        generator=generator, **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(dataset, sampler, device, loader=loader, channels_last=channels_last)


def eval_loader(dataset: Dataset, global_batch: int, *, world_size: int, rank: int, device: torch.device,
                num_workers: int | None = None, local_world_size: int = 1, resident: bool | None = None,
                channels_last: bool = False) -> DistributedLoader:
    batch = max(1, math.ceil(global_batch / world_size))
    sampler = ShardSampler(len(dataset), world_size, rank, batch)
    if _use_resident(dataset, device, resident, num_workers):
        return DistributedLoader(dataset, sampler, device, resident=Resident(dataset, device, channels_last=channels_last))
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler,
                        **loader_options(dataset, device, num_workers, local_world_size))
    return DistributedLoader(dataset, sampler, device, loader=loader, channels_last=channels_last)
