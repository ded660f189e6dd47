"""Small dataset files written in the real formats (IDX, CIFAR's pickled batches), and a small
augmented image set, for the tests of ddpkit.data."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import tarfile

import numpy as np
import torch

from ddpkit import data
from ddpkit.data import download

MNIST_FILES = download.SOURCES["mnist"].files


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, n_train: int = 20, n_test: int = 10, gz: bool = True, seed: int = 0) -> dict:
    """The four IDX files of an MNIST-style set; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) * 3) % 10,
    }
    os.makedirs(folder, exist_ok=True)
    for name, array in arrays.items():
        raw = idx_bytes(array)
        path = os.path.join(folder, name + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(raw, mtime=0) if gz else raw)
    return arrays


def cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"batch",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
        b"filenames": [b"x.png"] * n,
    }


def write_cifar(path, per_batch: int = 4, n_test: int = 10) -> dict:
    """cifar-10-python.tar.gz: data_batch_1..5, test_batch and batches.meta, pickled like the
    real ones (protocol 2, dicts with bytes keys); returns the batches by name."""
    batches = {f"data_batch_{i}": cifar_batch(per_batch, i) for i in range(1, 6)}
    batches["test_batch"] = cifar_batch(n_test, 9)
    meta = {b"label_names": [b"airplane"] * 10, b"num_cases_per_batch": per_batch, b"num_vis": 3072}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in [*batches.items(), ("batches.meta", meta)]:
            blob = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return batches


def md5(path) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


CPU = torch.device("cpu")


def image_set(n: int = 300, shape=(3, 12, 12), augment=True) -> data.ImageSet:
    ds = data.synthetic(shape, n, 10, seed=2).train
    ds.augment = data.Augment(crop_padding=3, flip=True) if augment else None
    return ds
