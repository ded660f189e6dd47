"""`download`: files fetched from a local HTTP mirror, verified and cached, a checksum mismatch
that leaves nothing behind, the offline error naming the files to place, and where the files
live. Nothing here touches the network."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import threading

import numpy as np
import pytest

from ddpkit import data
from ddpkit.data import download
from ddpkit.errors import UsageError
from tests.data.helpers import MNIST_FILES, idx_bytes, md5, write_cifar, write_mnist

pytestmark = pytest.mark.unit


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
    assert "\n" not in message and message.startswith(
        f"dataset mnist: not in {folder} and cannot be downloaded (no network"
    )
    assert f"place {', '.join(MNIST_FILES[:3])} in {folder}" in message and "--data-dir" in message


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(download.DATA_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert download.dataset_dir("mnist") == str(tmp_path / "xdg" / "ddpkit" / "data" / "mnist")
    monkeypatch.setenv(download.DATA_ENV, str(tmp_path / "env"))
    assert download.dataset_dir("cifar10") == str(tmp_path / "env" / "cifar10")
    assert download.dataset_dir("cifar10", str(tmp_path / "flag")) == str(tmp_path / "flag" / "cifar10")
