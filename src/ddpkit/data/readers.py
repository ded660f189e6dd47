"""Readers for the datasets' own file formats, with no torchvision.

- IDX (MNIST, Fashion-MNIST): a big-endian header (magic 0x00000803 for images, 0x00000801
  for labels, then one int32 per dimension) followed by the unsigned bytes; gzipped or not
  (told apart by the gzip magic, not the file name).
- CIFAR-10's python batches: pickled dicts with b'data' (N x 3072 uint8, the red, green and
  blue 32x32 planes of each image in turn) and b'labels', either in the published tar.gz or
  in the `cifar-10-batches-py/` folder it unpacks to.

Every check that fails raises a UsageError naming the file and what is wrong with it. The
pickles are read by an Unpickler that resolves only NumPy's array-rebuilding functions, so a
crafted file cannot run code.
"""

from __future__ import annotations

import gzip
import importlib
import io
import math
import os
import pickle
import tarfile
import zlib
from typing import IO, Any

import numpy as np

from ..errors import UsageError

IDX_IMAGES, IDX_LABELS = 0x00000803, 0x00000801
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
_BAD_ARCHIVE = (OSError, EOFError, zlib.error, tarfile.TarError)  # gzip.BadGzipFile is an OSError


def _corrupted(path: str, what: str) -> UsageError:
    return UsageError(f"{path}: corrupted or not the expected file ({what}); delete it to download it again")


def read_idx(path: str, magic: int) -> np.ndarray:
    """An IDX file (gzipped or not) as a uint8 array shaped by its header."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except _BAD_ARCHIVE as err:
        raise _corrupted(path, f"gzip: {err}") from None
    found = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if found != magic:
        got = "a file too short" if found is None else f"magic 0x{found:08x}"
        raise _corrupted(path, f"expected IDX magic 0x{magic:08x}, found {got}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    # math.prod on Python ints: NumPy's product of dimensions near 2**32 wraps around in int64,
    # and a wrapped size could match the file's and reach reshape.
    expected = header + math.prod(dims)
    if len(raw) != expected:
        raise _corrupted(path, f"header says {'x'.join(map(str, dims))} = {expected} bytes, file has {len(raw)}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def read_idx_pair(images_path: str, labels_path: str, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 1, H, W) uint8, labels (N,) int64) from an images file and its labels file."""
    images, labels = read_idx(images_path, IDX_IMAGES), read_idx(labels_path, IDX_LABELS)
    if len(images) != len(labels):
        raise _corrupted(labels_path, f"{len(labels)} labels for the {len(images)} images of {images_path}")
    if len(labels) and labels.max() >= num_classes:
        raise _corrupted(labels_path, f"label {labels.max()} outside 0..{num_classes - 1}")
    return images[:, None], labels.astype(np.int64)


class _ArrayUnpickler(pickle.Unpickler):
    """Resolves only what a pickled NumPy array (of any NumPy version) and bytes need."""

    ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy.core.numeric", "_frombuffer"),
            ("numpy._core.numeric", "_frombuffer"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module.startswith("numpy.core"):  # NumPy 1 names; NumPy 2 moved them to numpy._core
            try:
                return getattr(importlib.import_module(module.replace("numpy.core", "numpy._core")), name)
            except ImportError:
                pass
        return getattr(importlib.import_module(module), name)


def read_cifar_batch(f: IO[bytes], path: str) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: (images (N, 3, 32, 32) uint8, labels (N,) int64)."""
    try:
        batch = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as err:  # noqa: BLE001 - anything unpickling raises means a bad file
        raise _corrupted(path, f"unpickling: {type(err).__name__}: {err}") from None
    if not isinstance(batch, dict):
        raise _corrupted(path, f"a pickled {type(batch).__name__}, not a dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise _corrupted(path, f"b'data' should be an N x 3072 uint8 array, found {got}")
    try:
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        labels = np.empty(0)
    if len(labels) != len(data) or (len(labels) and not 0 <= labels.min() <= labels.max() < 10):
        raise _corrupted(path, f"b'labels' should be {len(data)} labels in 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar10(source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) from `cifar-10-python.tar.gz` or
    from the `cifar-10-batches-py` folder."""
    names = (*CIFAR_TRAIN, CIFAR_TEST)
    if os.path.isdir(source):
        batches = []
        for name in names:
            path = os.path.join(source, name)
            if not os.path.isfile(path):
                raise _corrupted(source, f"no {name} in it")
            with open(path, "rb") as f:
                batches.append(read_cifar_batch(f, path))
    else:
        batches = _read_cifar_tar(source, names)
    train_x = np.concatenate([b[0] for b in batches[:-1]])
    train_y = np.concatenate([b[1] for b in batches[:-1]])
    return train_x, train_y, batches[-1][0], batches[-1][1]


def _read_cifar_tar(path: str, names: tuple[str, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    try:
        with tarfile.open(path, "r:*") as tar:
            found = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
            missing = [n for n in names if n not in found]
            if missing:
                raise _corrupted(path, f"no {', '.join(missing)} in the archive")
            out = []
            for name in names:
                member = tar.extractfile(found[name])
                out.append(read_cifar_batch(io.BytesIO(member.read()), f"{path}:{found[name].name}"))
            return out
    except _BAD_ARCHIVE as err:
        raise _corrupted(path, f"archive: {err}") from None
