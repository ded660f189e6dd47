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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..core import checks
from ..errors import UsageError
from . import download, readers
from .images import ImageSet
from .text import VOCAB, text

# Datasets read from files: (input shape, classes), known without reading them, and the files'
# format (readers: IDX files, or CIFAR's pickled batches).
FILE_DATASETS = {"mnist": ((1, 28, 28), 10), "fashion-mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10)}
FILE_FORMATS = {"mnist": "idx", "fashion-mnist": "idx", "cifar10": "cifar"}
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
        from sklearn.datasets import load_digits  # 0.7 s, for --data digits alone

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
    if FILE_FORMATS[name] == "cifar":
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
    if FILE_FORMATS[name] == "cifar":
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


@dataclass(frozen=True)
class Request:
    """What a run asks of a dataset, from its flags: where its files are, the synthetic set's
    make, the text's path and sequence length."""

    data_dir: str | None = None
    synthetic_shape: tuple[int, ...] = (3, 32, 32)
    synthetic_size: int = 4096
    num_classes: int = 10
    seed: int = 0
    text_path: str | None = None
    seq_len: int = 128


def _nothing_to_prepare(name: str, r: Request) -> None:
    pass


@dataclass(frozen=True)
class Entry:
    """One dataset of the catalogue: how to load it, its (input shape, classes) without loading
    it, what to do once before the workers start (download, check), its training samples
    (default: those of what `load` gives), and whether it is text for a language model."""

    load: Callable[[str, Request], Splits]
    shape: Callable[[str, Request], tuple[tuple[int, ...], int]]
    prepare: Callable[[str, Request], None] = _nothing_to_prepare
    train_size: Callable[[str, Request], int] | None = None
    text: bool = field(default=False)


def _prepare_files(name: str, r: Request) -> None:
    """Download what a file dataset lacks into its folder, then check that it reads."""
    folder = download.dataset_dir(name, r.data_dir)
    _, missing = _local_files(name, folder)
    if missing:
        download.fetch(name, folder, missing)
    _read_files(name, r.data_dir)


def _check_text(r: Request) -> None:
    text(r.text_path, r.seq_len)  # read (and kept): a path without enough text is refused now


def _text(name: str, r: Request) -> Splits:
    train, test = text(r.text_path, r.seq_len)
    return Splits(train, test, (r.seq_len,), VOCAB)


# The catalogue: a dataset is an entry here (`register` adds one from outside).
CATALOGUE: dict[str, Entry] = {
    "digits": Entry(
        load=lambda name, r: digits(),
        shape=lambda name, r: ((1, 8, 8), 10),
        train_size=lambda name, r: len(_digits_array()) - DIGITS_TEST_SIZE,
    ),
    "synthetic": Entry(
        load=lambda name, r: synthetic(r.synthetic_shape, r.synthetic_size, r.num_classes, r.seed),
        shape=lambda name, r: (tuple(r.synthetic_shape), r.num_classes),
        train_size=lambda name, r: r.synthetic_size,
    ),
    "toy": Entry(load=lambda name, r: toy(), shape=lambda name, r: ((2,), 2)),
    **{
        name: Entry(
            load=lambda name, r: _read_files(name, r.data_dir),
            shape=lambda name, r: FILE_DATASETS[name],
            prepare=_prepare_files,
        )
        for name in FILE_DATASETS
    },
    "text": Entry(
        load=_text,
        shape=lambda name, r: ((r.seq_len,), VOCAB),
        prepare=lambda name, r: _check_text(r),
        text=True,
    ),
}
DATASETS = tuple(CATALOGUE)  # the names at import (the catalogue may grow: `register`)
TEXT_DATASETS = tuple(name for name, entry in CATALOGUE.items() if entry.text)  # for a language model


def register(name: str, entry: Entry) -> None:
    """Add a dataset to the catalogue under `name`."""
    CATALOGUE[name] = entry


def entry(name: str) -> Entry:
    """The catalogue's entry for `name` (a UsageError for an unknown one)."""
    checks.choice("--data", name, tuple(CATALOGUE))
    return CATALOGUE[name]


def load(name: str, **request: object) -> Splits:
    """Dataset `name`, for a `Request` of these fields. File datasets are read, never
    downloaded, here (see `prepare`). `text_path` and `seq_len` are `--data text`'s (None: the
    standard library's sources)."""
    return entry(name).load(name, Request(**request))


def prepare(name: str, data_dir: str | None = None, text_path: str | None = None, seq_len: int = 128) -> None:
    """What dataset `name` needs once before the workers start: a file dataset's downloads into
    its folder and a check that it reads, the text's read. Called by `ddpkit train`, so that
    workers only read (`load`)."""
    entry(name).prepare(name, Request(data_dir=data_dir, text_path=text_path, seq_len=seq_len))


def train_size(
    name: str, data_dir: str | None = None, synthetic_size: int = 4096, text_path: str | None = None, seq_len: int = 128
) -> int:
    """Training samples of dataset `name` (file datasets are read: call after `prepare`)."""
    r = Request(data_dir=data_dir, synthetic_size=synthetic_size, text_path=text_path, seq_len=seq_len)
    found = entry(name)
    return found.train_size(name, r) if found.train_size is not None else len(found.load(name, r).train)


def check_pairing(name: str, model: str, language: bool) -> None:
    """That dataset `name` feeds `model`: byte sequences (TEXT_DATASETS) a language model
    (`language`), anything else the others. One line for every command that takes both."""
    if name in TEXT_DATASETS and not language:
        raise UsageError(f"--data {name} is byte sequences for a language model: use --model gpt, not {model}")
    if language and name not in TEXT_DATASETS:
        raise UsageError(f"--model {model} is a language model of bytes: use it with --data text")


def check_applies(name: str, model: str, language: bool, given: Iterable[str], vocabulary: bool = False) -> None:
    """That each setting in `given` (set away from its default, named as "gpt_width") acts on
    this run of `model` on dataset `name`, where elsewhere it would change nothing: the gpt flags
    on a language model, --synthetic-shape, --synthetic-size and --num-classes on --data
    synthetic (--num-classes on a language model too, where it is the `vocabulary`), --seq-len
    on text. One line for every command that takes them; called once the model is known good,
    so that a wrong --model is said first. A dataset added with `register` may read any of
    these settings (its `Request`): its runs are not checked for them."""
    synthetic = ("synthetic_shape", "synthetic_size") + (() if vocabulary and language else ("num_classes",))
    built_in = name in DATASETS
    for setting in given:
        flag = "--" + setting.replace("_", "-")
        if setting.startswith("gpt_") and not language:
            raise UsageError(f"{flag} applies to --model gpt only (this run has --model {model})")
        if not built_in:
            continue
        if setting in synthetic and name != "synthetic":
            raise UsageError(f"{flag} applies to --data synthetic only (this run has --data {name})")
        if setting == "seq_len" and name not in TEXT_DATASETS:
            raise UsageError(f"{flag} applies to --data text only (this run has --data {name})")


def shape_of(
    name: str, synthetic_shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, seq_len: int = 128
) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset without loading it."""
    return entry(name).shape(name, Request(synthetic_shape=synthetic_shape, num_classes=num_classes, seq_len=seq_len))
