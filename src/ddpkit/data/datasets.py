"""The dataset catalogue: what each name is, its shape, and loading it.

- `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images), the offline default.
  Split fixed once for all runs: a permutation drawn with NumPy's PCG64 seeded 0 puts 1438
  images in train and 359 in test, whatever `--seed` is.
- `synthetic`: class templates plus noise, any shape, for speed tests that still learn.
- `toy`: the DDP tutorial's two-class problem in 2-D (5 train, 2 test points).
- `mnist`, `fashion-mnist` (IDX files) and `cifar10` (pickled batches): read from
  `--data-dir` (see `download` for the folder and the downloads, `readers` for the formats),
  normalized with each set's published per-channel mean and std.
- `text`: byte sequences for the language model, from `--text-path` or by default the Python
  standard library's sources (see `text`). Its "shape" is (seq_len,), its "classes" the 256
  byte values.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .. import checks
from ..errors import UsageError
from . import download, readers
from .images import ImageSet
from .text import VOCAB, text

DATASETS = ("digits", "synthetic", "toy", "mnist", "fashion-mnist", "cifar10", "text")
TEXT_DATASETS = ("text",)  # sequences for a language model; the others are for classifiers
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
    return Splits(
        ImageSet(x[train_idx], y[train_idx], mean, std), ImageSet(x[test_idx], y[test_idx], mean, std), (1, 8, 8), 10
    )


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
        labels = y[start : start + 4096]
        chunk = templates[labels] + 1.5 * torch.randn((len(labels), *shape), generator=g)
        x[start : start + 4096] = (127.5 + 32.0 * chunk).round().clamp(0, 255).to(torch.uint8)
    train = x[:size]
    mean = torch.stack([train[:, c].float().mean() for c in range(shape[0])])
    std = torch.stack([train[:, c].float().std() for c in range(shape[0])])
    return Splits(
        ImageSet(x[:size], y[:size], mean, std), ImageSet(x[size:], y[size:], mean, std), tuple(shape), num_classes
    )


def synthetic_bytes(shape: tuple[int, ...], size: int, num_classes: int) -> int:
    """About the most memory `synthetic(shape, size, num_classes)` holds at once: the class
    templates (float32), the samples (uint8 images, else float32 and the two float32 terms
    they are summed from), the labels (int64), and for images the float chunk being drawn
    and one channel of the training set as floats for its statistics."""
    n, values = size + max(1, size // 5), math.prod(shape)
    total = 4 * num_classes * values + 8 * n
    if len(shape) != 3:
        return total + 12 * n * values
    return total + n * values + 12 * min(n, 4096) * values + 4 * size * math.prod(shape[1:])


def train_size(
    name: str, data_dir: str | None = None, synthetic_size: int = 4096, text_path: str | None = None, seq_len: int = 128
) -> int:
    """Training samples of dataset `name` (file datasets are read: call after `prepare`)."""
    if name == "synthetic":
        return synthetic_size
    if name == "digits":
        return len(_digits_array()) - DIGITS_TEST_SIZE
    # toy, text, or files this process has read already
    return len(load(name, data_dir=data_dir, text_path=text_path, seq_len=seq_len).train)


def shape_of(
    name: str, synthetic_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, seq_len: int = 128
) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset without loading it."""
    if name in FILE_DATASETS:
        return FILE_DATASETS[name]
    if name == "text":
        return (seq_len,), VOCAB
    if name == "toy":
        return (2,), 2
    return ((1, 8, 8), 10) if name == "digits" else (tuple(synthetic_shape), num_classes)


def toy() -> Splits:
    """The two-class toy problem of the PyTorch DDP tutorials (S. Raschka's DDP script)."""
    train_x = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    test_x = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    return Splits(
        TensorDataset(train_x, torch.tensor([0, 0, 0, 1, 1])), TensorDataset(test_x, torch.tensor([0, 1])), (2,), 2
    )


def _local_files(name: str, folder: str) -> tuple[list[str], list[str]]:
    """(paths found, downloadable files missing) of a file dataset in `folder`. Each IDX file
    may be there gzipped or not; CIFAR-10 as the tar.gz or as the folder it unpacks to."""
    if name == "cifar10":
        extracted = os.path.join(folder, readers.CIFAR_FOLDER)
        if os.path.isdir(extracted):
            return [extracted], []
        candidates = [[f] for f in download.SOURCES[name].files]
    else:  # train images, train labels, test images, test labels
        candidates = [[f, f[: -len(".gz")]] for f in download.SOURCES[name].files]
    found, missing = [], []
    for names in candidates:
        paths = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
        found.extend(paths[:1])
        missing.extend([] if paths else names[:1])
    return found, missing


def prepare(name: str, data_dir: str | None = None, text_path: str | None = None, seq_len: int = 128) -> None:
    """Download what dataset `name` lacks into its folder, then check that it reads. Called
    once by `ddpkit train` before workers start, so they only read (`load`)."""
    if name == "text":  # read, to refuse a path without enough text before any worker starts
        text(text_path, seq_len)
        return
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
        raise UsageError(
            f"dataset {name}: {', '.join(missing)} not in {folder}: place them there (from "
            f"{download.urls(name)[0]}), let `ddpkit train` download them, or pass --data-dir"
        )
    key = (name, *((p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths))
    if key not in _READ:
        _READ.clear()  # one dataset at a time: a process that switches does not keep both
        _READ[key] = _parse_files(name, paths)
    train_x, train_y, test_x, test_y = _READ[key]
    mean, std = (torch.tensor(v) * 255 for v in NORMALIZATION[name])
    return Splits(
        ImageSet(train_x, train_y, mean, std),
        ImageSet(test_x, test_y, mean, std),
        FILE_DATASETS[name][0],
        FILE_DATASETS[name][1],
    )


def _parse_files(name: str, paths: list[str]) -> tuple[torch.Tensor, ...]:
    if name == "cifar10":
        train_x, train_y, test_x, test_y = readers.read_cifar10(paths[0])
    else:
        train_x, train_y = readers.read_idx_pair(paths[0], paths[1])
        test_x, test_y = readers.read_idx_pair(paths[2], paths[3])
    shape = FILE_DATASETS[name][0]
    test_path = paths[2] if len(paths) == 4 else paths[0]  # IDX: train images, labels, test images, labels
    for path, x in ((paths[0], train_x), (test_path, test_x)):
        if tuple(x.shape[1:]) != shape:
            raise UsageError(f"{path}: images of shape {tuple(x.shape[1:])}, expected {shape} for dataset {name}")
        if len(x) == 0:  # a run on it would take no step and "succeed"
            raise UsageError(f"{path}: holds no images; delete it to download it again")
    return (
        torch.from_numpy(train_x.copy()),
        torch.from_numpy(train_y),
        torch.from_numpy(test_x.copy()),
        torch.from_numpy(test_y),
    )


def load(
    name: str,
    *,
    data_dir: str | None = None,
    synthetic_shape: tuple[int, ...] = (3, 32, 32),
    synthetic_size: int = 4096,
    num_classes: int = 10,
    seed: int = 0,
    text_path: str | None = None,
    seq_len: int = 128,
) -> Splits:
    """Dataset `name`. File datasets are read, never downloaded, here (see `prepare`).
    `text_path` and `seq_len` are `--data text`'s (None: the standard library's sources)."""
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic(synthetic_shape, synthetic_size, num_classes, seed)
    if name == "toy":
        return toy()
    if name in FILE_DATASETS:
        return _read_files(name, data_dir)
    if name == "text":
        train, test = text(text_path, seq_len)
        return Splits(train, test, (seq_len,), VOCAB)
    checks.choice("--data", name, DATASETS)
    raise AssertionError(name)  # every name of DATASETS is handled above
