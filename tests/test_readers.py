"""Dataset files: readers on small files written here in the real formats (IDX, CIFAR's pickled
batches), the download code against a local HTTP server, the offline error, and `ddpkit train`
on such files. Nothing here touches the network."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import pickle
import socket
import tarfile
import threading

import numpy as np
import pytest
import torch

from ddpkit import data
from ddpkit.data import download, readers
from ddpkit.trainer import TrainConfig, resolve
from ddpkit.errors import UsageError

from .conftest import run_cli

MNIST_FILES = download.SOURCES["mnist"].files


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, n_train: int = 20, n_test: int = 10, gz: bool = True, seed: int = 0) -> dict:
    """The four IDX files of an MNIST-style set; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
              "train-labels-idx1-ubyte": np.arange(n_train) % 10,
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
              "t10k-labels-idx1-ubyte": (np.arange(n_test) * 3) % 10}
    os.makedirs(folder, exist_ok=True)
    for name, array in arrays.items():
        raw = idx_bytes(array)
        path = os.path.join(folder, name + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(raw, mtime=0) if gz else raw)
    return arrays


def cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"batch", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8), b"filenames": [b"x.png"] * n}


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


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A local HTTP mirror of tmp_path/served (DDPKIT_DATA_MIRROR points at it); its
    `.requests` lists the paths asked for."""
    root = tmp_path / "served"
    root.mkdir()
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet, but counted
            requests.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(download.MIRROR_ENV, f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.root, httpd.requests = root, requests
    yield httpd
    httpd.shutdown()
    httpd.server_close()


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


def test_download_verifies_caches_and_is_not_repeated(tmp_path, server, monkeypatch):
    write_mnist(server.root / "mnist")
    sums = {f: md5(server.root / "mnist" / f) for f in MNIST_FILES}
    monkeypatch.setitem(download.CHECKSUMS, "mnist", sums)
    cache = tmp_path / "cache"
    data.prepare("mnist", str(cache))
    assert sorted(os.listdir(cache / "mnist")) == sorted(MNIST_FILES)  # no temp files left
    assert len(server.requests) == 4
    assert data.load("mnist", data_dir=str(cache)).train.images.shape == (20, 1, 28, 28)
    data.prepare("mnist", str(cache))
    assert len(server.requests) == 4  # cached: no second download


def test_download_checksum_mismatch_leaves_nothing(tmp_path, server, monkeypatch):
    write_cifar(str(server.root / "cifar10" / "cifar-10-python.tar.gz"))
    monkeypatch.setitem(download.CHECKSUMS, "cifar10", {"cifar-10-python.tar.gz": "0" * 32})
    got = md5(server.root / "cifar10" / "cifar-10-python.tar.gz")
    with pytest.raises(UsageError) as err:
        data.prepare("cifar10", str(tmp_path / "cache"))
    message = str(err.value)
    assert "cifar-10-python.tar.gz: checksum mismatch" in message and "0" * 32 in message and got in message
    assert os.listdir(tmp_path / "cache" / "cifar10") == []


def test_offline_error_lists_files_to_place(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(download.MIRROR_ENV, f"http://127.0.0.1:{port}")
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3)))  # placed, not asked for
    with pytest.raises(UsageError) as err:
        data.prepare("mnist", str(tmp_path))
    message = str(err.value)
    folder = str(tmp_path / "mnist")
    assert "\n" not in message and message.startswith(f"dataset mnist: not in {folder} and cannot be downloaded (no network")
    assert f"place {', '.join(MNIST_FILES[:3])} in {folder}" in message and "--data-dir" in message


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(download.DATA_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert download.dataset_dir("mnist") == str(tmp_path / "xdg" / "ddpkit" / "data" / "mnist")
    monkeypatch.setenv(download.DATA_ENV, str(tmp_path / "env"))
    assert download.dataset_dir("cifar10") == str(tmp_path / "env" / "cifar10")
    assert download.dataset_dir("cifar10", str(tmp_path / "flag")) == str(tmp_path / "flag" / "cifar10")


def test_config_knows_shapes_without_files():
    resolve(TrainConfig(data="cifar10", model="lenet", augment="crop-flip"))
    resolve(TrainConfig(data="mnist", model="lenet"))
    with pytest.raises(UsageError, match="--augment"):
        resolve(TrainConfig(data="toy", model="mlp", augment="flip"))
    toy = data.load("toy")
    assert toy.train.tensors[0].dtype == torch.float32 and toy.train.tensors[1].tolist() == [0, 0, 0, 1, 1]
    assert data.shape_of("toy") == ((2,), 2) and len(toy.test) == 2


def test_train_mnist_files_on_two_processes(tmp_path):
    write_mnist(tmp_path / "data" / "mnist", n_train=32, n_test=8)
    out = tmp_path / "run"
    proc = run_cli("train", "--data", "mnist", "--data-dir", str(tmp_path / "data"), "--model", "lenet",
                   "--epochs", "1", "--nproc", "2", "--device", "cpu", "--batch-size", "16", "--out", str(out),
                   env={download.MIRROR_ENV: "http://127.0.0.1:9"})  # never asked: the files are there
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["data"] == "mnist" and results["world_size"] == 2 and results["test_samples"] == 8, results


def test_train_cli_errors_and_toy(tmp_path):
    folder = tmp_path / "data" / "mnist"
    write_mnist(folder)
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    proc = run_cli("train", "--data", "mnist", "--data-dir", str(tmp_path / "data"), "--model", "mlp",
                   "--device", "cpu", "--out", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "t10k-images-idx3-ubyte.gz: corrupted" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("train", "--data", "toy", "--model", "mlp", "--epochs", "3", "--nproc", "1", "--device", "cpu",
                   "--batch-size", "2", "--out", str(tmp_path / "toy"))
    assert proc.returncode == 0, proc.stderr[-3000:]
