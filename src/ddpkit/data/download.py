"""Dataset files: where they live, and fetching the missing ones from their canonical sources.

Folder: `--data-dir` > the `DDPKIT_DATA` environment variable > `$XDG_CACHE_HOME/ddpkit/data`
(default `~/.cache/ddpkit/data`); each dataset in its own subfolder (`DIR/mnist/`, ...).

A file already there is used as it is (the readers check its format; a user may place
uncompressed IDX files or an extracted CIFAR folder). A file that is missing is downloaded to a
temporary file in the same folder, its MD5 compared with the published one (`CHECKSUMS`), and
only then renamed into place, so a half-written or wrong file never carries the real name.
Concurrent downloads of one file (several workers under torchrun) are therefore safe, only
wasteful.

`DDPKIT_DATA_MIRROR=URL` replaces every source by `URL/<dataset>/<file>` (a local mirror; the
tests serve their own files this way and patch `CHECKSUMS` to match them).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Source:
    urls: tuple[str, ...]  # base URLs, tried in order (the first is the canonical one)
    files: tuple[str, ...]  # what to download from each


_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

SOURCES: dict[str, Source] = {
    # The mirror torchvision uses, then the original page (which often refuses robots).
    "mnist": Source(
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"), _MNIST_FILES
    ),
    "fashion-mnist": Source(("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",), _MNIST_FILES),
    "cifar10": Source(("https://www.cs.toronto.edu/~kriz/",), ("cifar-10-python.tar.gz",)),
}

# The published MD5 sums (the ones torchvision's dataset classes list). A module-level table
# so that tests serving their own small files can patch in the sums of those.
CHECKSUMS: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
}

MIRROR_ENV = "DDPKIT_DATA_MIRROR"
DATA_ENV = "DDPKIT_DATA"
TIMEOUT = 30.0  # seconds without an answer before a source counts as unreachable
_CHUNK = 1 << 20


def data_root(data_dir: str | None = None) -> str:
    """The folder holding one subfolder per dataset."""
    if data_dir:
        return os.path.expanduser(data_dir)
    if os.environ.get(DATA_ENV):
        return os.path.expanduser(os.environ[DATA_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ddpkit", "data")


def dataset_dir(name: str, data_dir: str | None = None) -> str:
    return os.path.join(data_root(data_dir), name)


def urls(name: str) -> tuple[str, ...]:
    mirror = os.environ.get(MIRROR_ENV)
    return (f"{mirror.rstrip('/')}/{name}/",) if mirror else SOURCES[name].urls


def fetch(name: str, folder: str, files: list[str]) -> None:
    """Download `files` of dataset `name` into `folder`, each checked against CHECKSUMS.

    No network (or no source answering): one UsageError line saying which files to place where.
    A checksum mismatch: a UsageError naming the file and both sums, and nothing left behind.
    """
    for filename in files:
        failures = []
        for base in urls(name):
            try:
                _download(base + filename, folder, filename, CHECKSUMS[name][filename])
                break
            except urllib.error.HTTPError as err:  # the server answered, but not with the file
                failures.append(f"{err.code} {err.reason} from {base + filename}")
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                failures.append(f"no network: {getattr(err, 'reason', None) or err}")
        else:
            raise UsageError(
                f"dataset {name}: not in {folder} and cannot be downloaded ({failures[0]}): "
                f"place {', '.join(files)} in {folder} (from {urls(name)[0]}), or pass --data-dir"
            )


def _download(url: str, folder: str, filename: str, md5: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        total = int(response.headers.get("Content-Length") or 0)
        fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".part", dir=folder)
        try:
            digest = _copy(response, fd, total, filename)
            if digest != md5:
                raise UsageError(
                    f"{os.path.join(folder, filename)}: checksum mismatch for the download from {url}: "
                    f"expected MD5 {md5}, got {digest}"
                )
            os.replace(tmp, os.path.join(folder, filename))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _copy(response, fd: int, total: int, filename: str) -> str:
    """Write the response to `fd`, with a progress bar on stderr for big files; its MD5."""
    from tqdm.auto import tqdm  # 3-30 ms, for a download alone: not in every worker that reads the data

    # tqdm starts a monitor thread with its first bar (even a disabled one). This runs in the
    # launching process, and a live thread there makes the launcher spawn workers instead of
    # forking them (seconds slower): without the monitor, tqdm refreshes on updates only.
    tqdm.monitor_interval = 0
    md5 = hashlib.md5()
    # disable=None: a bar only when stderr is a terminal; never for small files.
    with (
        os.fdopen(fd, "wb") as out,
        tqdm(
            total=total or None,
            unit="B",
            unit_scale=True,
            desc=filename,
            file=sys.stderr,
            disable=None if total >= 8 * _CHUNK else True,
        ) as bar,
    ):
        while chunk := response.read(_CHUNK):
            md5.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return md5.hexdigest()
