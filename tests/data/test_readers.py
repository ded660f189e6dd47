"""`readers`: the MNIST-style (IDX) and CIFAR-10 readers on small files written here in the real
formats, corrupted files named, and pickles that cannot run code."""

from __future__ import annotations

import gzip
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from ddpkit import data
from ddpkit.data import readers
from ddpkit.errors import UsageError
from tests.data.helpers import cifar_batch, idx_bytes, write_cifar, write_mnist

pytestmark = pytest.mark.unit


def test_idx_readers_gz_and_raw(tmp_path):
    written = write_mnist(tmp_path / "mnist", gz=True)
    raw = write_mnist(tmp_path / "fashion-mnist", gz=False, seed=1)
    for name, arrays in (("mnist", written), ("fashion-mnist", raw)):
        splits = data.load(name, data_dir=str(tmp_path))
        assert splits.in_shape == (1, 28, 28) and splits.num_classes == 10
        assert splits.train.images.dtype == torch.uint8 and splits.train.images.shape == (20, 1, 28, 28)
        assert splits.test.images.shape == (10, 1, 28, 28) and splits.train.labels.dtype == torch.int64
        assert torch.equal(splits.train.images[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]).byte())
        assert splits.test.labels.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
        mean, std = data.NORMALIZATION[name]
        x, _ = splits.train.batch(torch.tensor([0]))
        expected = (splits.train.images[0].float() / 255 - mean[0]) / std[0]
        assert torch.allclose(x[0], expected, atol=1e-5)
    assert data.shape_of("fashion-mnist") == ((1, 28, 28), 10)


def test_cifar_reader_tar_and_folder(tmp_path):
    batches = write_cifar(str(tmp_path / "cifar10" / "cifar-10-python.tar.gz"))
    splits = data.load("cifar10", data_dir=str(tmp_path))
    assert splits.train.images.shape == (20, 3, 32, 32) and splits.test.images.shape == (10, 3, 32, 32)
    assert splits.train.images.dtype == torch.uint8 and splits.in_shape == (3, 32, 32)
    first = batches["data_batch_1"][b"data"][0]  # red plane, then green, then blue
    assert torch.equal(splits.train.images[0, 1].flatten(), torch.from_numpy(first[1024:2048]))
    assert splits.train.labels[4:8].tolist() == batches["data_batch_2"][b"labels"]
    assert torch.allclose(splits.train.mean.flatten(), torch.tensor([0.4914, 0.4822, 0.4465]) * 255)
    # The folder the archive unpacks to is read as well (and preferred).
    with tarfile.open(tmp_path / "cifar10" / "cifar-10-python.tar.gz") as tar:
        tar.extractall(tmp_path / "cifar10", filter="data")
    os.remove(tmp_path / "cifar10" / "cifar-10-python.tar.gz")
    again = data.load("cifar10", data_dir=str(tmp_path))
    assert torch.equal(again.test.images, splits.test.images)


def test_corrupted_files_are_named(tmp_path):
    folder = tmp_path / "mnist"
    write_mnist(folder)
    path = folder / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-30])  # truncated gzip
    with pytest.raises(UsageError, match="train-images-idx3-ubyte.gz: corrupted"):
        data.load("mnist", data_dir=str(tmp_path))
    path.write_bytes(gzip.compress(idx_bytes(np.zeros((3, 28, 28)))[:-5]))  # IDX shorter than its header says
    with pytest.raises(UsageError, match="header says 3x28x28"):
        data.load("mnist", data_dir=str(tmp_path))
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros((3, 28, 28)))))
    with pytest.raises(UsageError, match="train-labels-idx1-ubyte.gz.*expected IDX magic 0x00000801"):
        readers.read_idx(str(folder / "train-labels-idx1-ubyte.gz"), readers.IDX_LABELS)
    tgz = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    write_cifar(str(tgz))
    tgz.write_bytes(tgz.read_bytes()[:200])
    with pytest.raises(UsageError, match="cifar-10-python.tar.gz: corrupted"):
        data.load("cifar10", data_dir=str(tmp_path))


def test_pickles_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'owned'}",))

    folder = tmp_path / "cifar10" / readers.CIFAR_FOLDER
    folder.mkdir(parents=True)
    for name in (*readers.CIFAR_TRAIN, readers.CIFAR_TEST):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(2, 0), protocol=4))
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(UsageError, match=r"data_batch_3: corrupted.*refusing to load (posix|nt)\.system"):
        data.load("cifar10", data_dir=str(tmp_path))
    assert not (tmp_path / "owned").exists()
    (folder / "data_batch_3").write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(UsageError, match="data_batch_3.*N x 3072 uint8"):
        data.load("cifar10", data_dir=str(tmp_path))


def test_an_idx_header_whose_size_overflows_int64_is_named(tmp_path):
    # 2**31 cubed wraps around to 0 in NumPy's int64 product: a header-only file would then
    # pass the length check and fail in reshape with a traceback.
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 8, 3]) + (2**31).to_bytes(4, "big") * 3)
    with pytest.raises(UsageError, match=r"train-images-idx3-ubyte: corrupted .*header says 2147483648x"):
        readers.read_idx(str(path), readers.IDX_IMAGES)


def test_a_dataset_file_with_no_images_is_named(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=0)
    with pytest.raises(UsageError, match=r"train-images-idx3-ubyte.gz: holds no images"):
        data.load("mnist", data_dir=str(tmp_path))
    write_mnist(tmp_path / "fashion-mnist", n_test=0)
    with pytest.raises(UsageError, match=r"t10k-images-idx3-ubyte.gz: holds no images"):
        data.load("fashion-mnist", data_dir=str(tmp_path))
