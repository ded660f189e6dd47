"""Writing files so that a crash never leaves half of one, and checking up front that a place
is writable.

Every write goes to a temp file in the target's directory, is flushed to disk, and is renamed
over the target: a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from .errors import UsageError


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path` ('w' text or 'wb' bytes); on a clean exit it is synced
    and renamed to `path`, on an exception removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=directory)
    try:
        # mkstemp makes the file owner-only; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """`obj` as indented JSON; values JSON does not know (paths, dtypes) as their str()."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_yaml(path: str | os.PathLike, mapping: dict[str, Any]) -> None:
    import yaml

    write_text(path, yaml.safe_dump(mapping, sort_keys=False))


def check_writable(what: str, folder: str | os.PathLike) -> None:
    """Create `folder` if needed and prove a file can be made in it (a file of its own: under
    torchrun or srun every rank may run this check at once), so that a run fails now with one
    line rather than after its work is done."""
    folder = os.fspath(folder) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-write-test-"):
            pass
    except FileExistsError:
        raise UsageError(f"{what}: {folder} exists and is not a directory") from None
    except OSError as err:
        raise UsageError(f"{what}: cannot write there ({err.strerror})") from None
