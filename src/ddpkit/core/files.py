"""Writing files so that a crash never leaves half of one, never writing through a symbolic
link, holding a directory for one process, and checking up front that a place is writable.

Every write goes to a new temp file in the target's directory, is flushed to disk, and is
renamed over the target: a reader sees the old file or the new one, never a mix, and a link at
the target's name is replaced, never followed (`os.replace` renames over the link itself).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import math
import os
import pickle
import shutil
import socket
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from typing import IO, Any

from ..errors import UsageError

TEMP_PREFIX = ".tmp-"  # every temp file of a write in progress; see prune_temp_files
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path` ('w' text or 'wb' bytes); on a clean exit it is synced
    and renamed to `path`, on an exception removed. A full disk is an OSError(ENOSPC) naming
    `path`, whatever layer noticed it."""
    path = os.fspath(path)
    fd, tmp = _temp_beside(path)
    try:
        with naming_full_disk(path):
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def replace_with_log(path: str | os.PathLike, head: str = "", newline: str | None = None) -> IO[str]:
    """A file that grows as a run goes (a metrics log): a new file holding `head` takes the
    place of `path` (temp file and rename, as `atomic_write`), then stays open, line-buffered,
    for appending. Its lines go to that file whatever later happens to the name."""
    path = os.fspath(path)
    fd, tmp = _temp_beside(path)
    f = os.fdopen(fd, "w", buffering=1, newline=newline)
    try:
        with naming_full_disk(path):
            f.write(head)
            f.flush()
            os.replace(tmp, path)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return f


@contextlib.contextmanager
def naming_full_disk(path: str) -> Iterator[None]:
    """A full disk (ENOSPC, or a quota: EDQUOT) inside becomes OSError(errno, strerror, `path`):
    a write to an open file says neither which file nor, through torch, even what went wrong."""
    try:
        yield
    except OSError as err:
        if err.errno in FULL_DISK and err.filename != path:
            raise OSError(err.errno, os.strerror(err.errno), path) from None
        raise


def _temp_beside(path: str) -> tuple[int, str]:
    """A new temp file in `path`'s directory (made if need be), with the mode a plain open()
    would give. mkstemp creates it exclusively: a planted link under its name is refused."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=os.path.splitext(path)[1], dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes the file owner-only
    return fd, tmp


def prune_temp_files(folder: str | os.PathLike) -> list[str]:
    """Remove what writes in `folder` left when their process died mid-write (a SIGKILL, a
    power cut: no `except` ran), files and checkpoint directories; the names removed. Only while no write of ours can be under
    way there: a run holds its directory's lock."""
    folder = os.fspath(folder)
    try:
        names = [n for n in os.listdir(folder) if n.startswith(TEMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        remove(os.path.join(folder, name))
    return names


def remove(path: str | os.PathLike) -> None:
    """Remove a file, or a directory with what it holds (a link itself, never what it names)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def json_safe(value: Any) -> Any:
    """`value` with every NaN and infinity as None: JSON has no such numbers, and strict
    parsers reject the bare `NaN` that Python's json writes by default."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_line(obj: Any, **kwargs: Any) -> str:
    """Strict JSON of `obj` (non-finite numbers as null); values JSON does not know (paths,
    dtypes) as their str()."""
    return json.dumps(json_safe(obj), allow_nan=False, default=str, **kwargs)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """`obj` as indented, strict JSON (see `json_line`)."""
    write_text(path, json_line(obj, indent=2) + "\n")


def write_yaml(path: str | os.PathLike, mapping: dict[str, Any]) -> None:
    import yaml  # 7 ms, for config.yaml alone

    write_text(path, yaml.safe_dump(mapping, sort_keys=False))


def check_writable(what: str, folder: str | os.PathLike) -> None:
    """Create `folder` if needed and prove a file can be made in it (a file of its own: under
    torchrun or srun every rank may run this check at once), so that a run fails now with one
    line rather than after its work is done."""
    folder = os.fspath(folder) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        # Not TEMP_PREFIX: the rank that prunes temp files must not remove another rank's probe.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except FileExistsError:
        raise UsageError(f"{what}: {folder} exists and is not a directory") from None
    except OSError as err:
        raise UsageError(f"{what}: cannot write there ({err.strerror})") from None


# -- one process per directory ------------------------------------------------------------------

_held: dict[str, int] = {}  # lock file -> the descriptor that holds it, until this process exits


def hold_lock(path: str | os.PathLike, what: str, advice: str = "wait for it to end") -> dict[str, Any] | None:
    """Take the exclusive lock on the file `path` (made if need be) for the rest of this
    process's life, and write this process's pid, host and start time in it. Returns what a
    previous holder wrote if it ended without unlocking (it was killed), else None. Another
    live holder is a UsageError naming `what` and that holder. Holding it already is fine.

    flock(2): the kernel drops a lock when the last descriptor of its holder closes, so a
    killed process's lock is free again at once (no pid to check for liveness), and forked
    children (the CPU workers) hold it along with their parent while they run."""
    path = os.path.abspath(path)
    if _holding(path):
        return None
    while True:
        fd = _open_lock(path, what)
        if not _flock_soon(fd):
            holder = _holder_of(fd)
            os.close(fd)
            raise UsageError(f"{what}: in use by {holder}; {advice}") from None
        if _same_file(path, fd):
            break
        os.close(fd)  # its holder removed the file as we opened it: lock the one there now
    previous = _read_holder(fd)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    _held[path] = fd
    atexit.register(_release, path, fd, os.getpid())
    return previous


def check_unlocked(path: str | os.PathLike, what: str, advice: str = "wait for it to end") -> None:
    """UsageError (as `hold_lock`'s) when a live process holds the lock file `path`; writes
    nothing, creates nothing."""
    path = os.path.abspath(path)
    if _holding(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as err:
        raise UsageError(f"{what}: cannot read its lock file {path} ({err.strerror})") from None
    try:
        import fcntl  # POSIX only, as the lock is

        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a shared lock: only a holder's exclusive one conflicts
    except BlockingIOError:
        raise UsageError(f"{what}: in use by {_holder_of(fd)}; {advice}") from None
    finally:
        os.close(fd)


def _flock_soon(fd: int, patience_s: float = 0.3) -> bool:
    """The exclusive lock, waiting a moment for it: another run's `check_unlocked` holds a
    shared one for an instant, which is no reason to refuse."""
    import fcntl  # POSIX only, as the lock is

    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def describe_holder(holder: dict[str, Any] | None) -> str:
    """'another process: pid P on HOST (started T)', from what a lock's holder wrote."""
    if not holder:
        return "another process"
    pid, host, started = (holder.get(k, "?") for k in ("pid", "host", "started"))
    return f"another process: pid {pid} on {host} (started {started})"


def _holding(path: str) -> bool:
    """True if this process holds the lock on `path` still (the file may have been removed
    and made anew since: then the old descriptor is let go)."""
    fd = _held.get(path)
    if fd is None:
        return False
    if _same_file(path, fd):
        return True
    del _held[path]
    os.close(fd)
    return False


def _open_lock(path: str, what: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UsageError(f"{what}: its lock file {path} is a symbolic link; remove it") from None
        raise UsageError(f"{what}: cannot create its lock file {path} ({err.strerror})") from None


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _holder_of(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (which it does right after locking: wait
    a moment for that)."""
    for _ in range(20):
        holder = _read_holder(fd)
        if holder:
            return describe_holder(holder)
        time.sleep(0.05)
    return describe_holder(None)


def _release(path: str, fd: int, owner: int) -> None:
    """At exit: remove the lock file, then unlock. (A forked child inherits the handler but
    must not release its parent's lock.) Removing first means a process that opened the old
    file and locks it after us sees that it is gone and tries again (see `hold_lock`)."""
    if os.getpid() != owner or _held.get(path) != fd:
        return
    if _same_file(path, fd):
        with contextlib.suppress(OSError):
            os.unlink(path)
    os.close(fd)
    del _held[path]


def save_file(path: str | os.PathLike, obj: Any) -> None:
    """`torch.save(obj)` to `path`, atomically; a full disk is the write's OSError, naming the file."""
    import torch  # here: the modules that write text and JSON do not wait for torch's import

    with atomic_write(path, "wb") as f:
        writer = _Writes(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            # torch's zip writer turns the OSError of a write (a full disk) into "[enforce fail
            # at inline_container.cc] unexpected pos": raise the real one (atomic_write names the file).
            if writer.error is not None:
                raise writer.error from None
            raise


class _Writes:
    """A binary file for torch.save that keeps the OSError a write raised."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Load a file written by `save_file` or `torch.save`. A missing, truncated, corrupted or
    code-carrying file raises UsageError with one line naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {path}: no such file")
    verify_file(path)
    import torch  # here: the modules that write text and JSON do not wait for torch's import

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch names the global it refused to import; anything else is garbage, not a threat.
        refused = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
        if refused:
            raise UsageError(f"checkpoint {path}: refused, loading it would run code ({refused[0]})") from None
        raise UsageError(f"checkpoint {path}: not a readable PyTorch file (corrupt or not a checkpoint)") from None
    except Exception as err:  # noqa: BLE001 - garbage bytes can fail anywhere inside the unpickler
        raise UsageError(f"checkpoint {path}: not a readable PyTorch file ({type(err).__name__})") from None


def verify_file(path: str) -> None:
    """Refuse a file whose bytes do not match the checksums written with them: torch.save's zip
    stores a CRC-32 of every record (the pickle, each tensor's bytes), which torch.load never
    checks, so flipped bytes in a tensor would load as weights. A file that is no zip (torch's
    legacy format, or one cut short before its directory) has none: torch.load judges it."""
    try:
        if not zipfile.is_zipfile(path):
            return
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every record and compares its CRC-32: about 5 GB/s
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError) as err:
        raise UsageError(f"checkpoint {path}: damaged ({type(err).__name__} in its zip records)") from None
    if bad is not None:
        raise UsageError(f"checkpoint {path}: damaged ({bad} does not match the checksum written with it)")
