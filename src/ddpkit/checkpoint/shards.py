"""Sharded checkpoints (fsdp): a directory in which every rank writes its own shards through
torch's Distributed Checkpoint (DCP), read back onto any number of processes and into any
strategy, without unpickling code.

A checkpoint directory holds:

    .metadata, __R_0.distcp   DCP's files: "model" and "optimizer" (and an EMA's average), in
                              the fully-qualified-name form of torch's state-dict helpers (each
                              rank's own shards)
    state.pt                  everything else (scheduler, loader position, run state): one
                              file rank 0 writes, read with weights_only=True
    checksums.json            the size and CRC-32 of each file above, written last by rank 0

It is written under a `.tmp-*` name beside its final one and renamed once every rank's shards,
DCP's metadata, state.pt and the checksums are on disk, so a directory with a checkpoint's name
is complete; and it is read only once every file matches its checksum (`verify`), so damaged
bytes (a flipped bit on a disk, a copy cut short, a hand) are never trained on. DCP's shards
carry no checksum of their own.
Its metadata is read here, not by DCP: DCP unpickles `.metadata` with plain `pickle.load`, and
the optimizer's non-tensor entries with `torch.load(weights_only=False)`, either of which runs
whatever code a planted file carries. `read_metadata` admits only DCP's own metadata classes,
and non-tensor entries load with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
import threading
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from ..core import checks, dist
from ..core.files import FULL_DISK, TEMP_PREFIX, load_file, remove, save_file, write_json
from ..errors import UsageError

# Imports inside functions: torch's Distributed Checkpoint (0.5-0.6 s to import) loads with
# the first checkpoint directory, not in every process that imports ddpkit's checkpoints.

STATE_FILE = "state.pt"
METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"
DATA_FILE = re.compile(r"__\d+_\d+\.distcp")  # what DCP's FileSystemWriter names its data files

# Everything DCP's metadata pickle holds (torch 2.13): its dataclasses, tensor sizes and dtypes.
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
}


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    return os.path.isdir(path)


class _Refused(pickle.UnpicklingError):
    """The metadata pickle names a global outside DCP's metadata classes."""


# Classes whose instances the metadata may give state to (pickle's BUILD), and what state.
_STATEFUL = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python one: its BUILD can be checked
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def load_build(self) -> None:
        # BUILD sets attributes on the object below it, which may be an admitted class itself:
        # state for pathlib.PosixPath would rewrite that class in this process (and, through
        # fork, in the workers). Only DCP's own instances get state, and only their own fields.
        inst, state = self.stack[-2], self.stack[-1]
        if not _state_allowed(inst, state):
            raise _Refused(f"state for {type(inst).__module__}.{type(inst).__name__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _state_allowed(inst: Any, state: Any) -> bool:
    import dataclasses

    cls = type(inst)
    if isinstance(inst, type) or cls.__module__ not in _STATEFUL or cls.__name__ not in ALLOWED[cls.__module__]:
        return False
    if "__setstate__" in vars(cls):  # the class reads its state itself (TensorProperties)
        return True
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return all(part is None or (isinstance(part, dict) and set(part) <= fields) for part in parts)


def read_metadata(path: str | os.PathLike) -> Any:
    """DCP's metadata of the checkpoint directory `path`, checked: every data file it names is
    one of DCP's, inside the directory, and long enough for what it is said to hold. Raises
    UsageError naming the directory when the checkpoint is incomplete, damaged or would run
    code."""
    path = os.fspath(path)
    from torch.distributed.checkpoint.metadata import Metadata

    where = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(where):  # DCP would fall back to per-rank metadata files: never
        raise UsageError(f"checkpoint {path}: incomplete (no {METADATA_FILE}: its write never finished)")
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except _Refused as err:
        raise UsageError(f"checkpoint {path}: refused, loading its {METADATA_FILE} would run code ({err})") from None
    except Exception:  # noqa: BLE001 - garbage bytes fail anywhere inside the unpickler
        raise UsageError(f"checkpoint {path}: damaged ({METADATA_FILE} is not readable)") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UsageError(f"checkpoint {path}: damaged ({METADATA_FILE} is not DCP metadata)")
    _check_data_files(path, metadata.storage_data)
    _check_entries(path, metadata)
    return metadata


def _check_entries(path: str, metadata: Any) -> None:
    """Every entry's data is where the metadata says, and no bigger than what is stored: a
    tensor that claims terabytes, or has no data at all, is damage found here (from the
    metadata alone) rather than an allocation failing in every worker."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    storage = metadata.storage_data
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise UsageError(f"checkpoint {path}: damaged ({METADATA_FILE} has no data for {checks.cut(key, 120)})")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise UsageError(f"checkpoint {path}: damaged ({METADATA_FILE} holds an entry of no known kind)")
        try:
            claimed = math.prod(entry.size) * torch.empty((), dtype=entry.properties.dtype).element_size()
            stored = 0
            for chunk in entry.chunks:
                if any(o < 0 or o + n > whole for o, n, whole in zip(chunk.offsets, chunk.sizes, entry.size)):
                    raise ValueError("a chunk outside its tensor")
                stored += storage[MetadataIndex(key, chunk.offsets)].length
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError):
            raise UsageError(
                f"checkpoint {path}: damaged ({METADATA_FILE} has no data for {checks.cut(key, 120)})"
            ) from None
        if claimed > stored:  # each chunk is stored whole (a torch.save record): never fewer bytes
            raise UsageError(
                f"checkpoint {path}: damaged ({checks.cut(key, 120)} claims {claimed:,} bytes, its data holds {stored:,})"
            )


def check_values(path: str | os.PathLike, metadata: Any) -> None:
    """Load every non-tensor entry (an optimizer's lr, betas, ...) as a resume will, with
    weights_only=True, so that one that would need code to load is refused where the checkpoint
    is chosen, before any worker starts. They are small: a few hundred bytes each."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = os.fspath(path)
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(key)]
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as err:  # noqa: BLE001 - refused globals and garbage alike
            raise UsageError(f"checkpoint {path}: {_load_failure(err)}") from None


def _check_data_files(path: str, storage: dict[Any, Any]) -> None:
    need: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(name, str) and DATA_FILE.fullmatch(name)) or not all(
            isinstance(v, int) and v >= 0 for v in (offset, length)
        ):
            raise UsageError(f"checkpoint {path}: damaged ({METADATA_FILE} names a data file {checks.shown(name)})")
        need[name] = max(need.get(name, 0), offset + length)
    for name, size in sorted(need.items()):
        try:
            have = os.path.getsize(os.path.join(path, name))
        except OSError:
            raise UsageError(f"checkpoint {path}: incomplete ({name} is missing)") from None
        if have < size:
            raise UsageError(f"checkpoint {path}: truncated ({name} holds {have} of {size} bytes)")


def crc32(path: str, chunk: int = 1 << 22) -> int:
    """The CRC-32 of a file's bytes (zlib's: about 5 GB/s on one core, the GIL released)."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return value


def write_checksums(folder: str) -> None:
    """Record the size and CRC-32 of every file of the checkpoint directory `folder` in its
    checksums.json, synced before the directory is renamed into place (rank 0, once every
    rank's shards are written)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        where = os.path.join(folder, name)
        if name != CHECKSUMS_FILE and not name.startswith(TEMP_PREFIX) and os.path.isfile(where):
            files[name] = {"size": os.path.getsize(where), "crc32": crc32(where)}
    write_json(os.path.join(folder, CHECKSUMS_FILE), {"algorithm": "crc32", "files": files})


def verify(path: str | os.PathLike) -> None:
    """Raise UsageError naming the checkpoint directory `path` unless every file its
    checksums.json lists (at least DCP's metadata and data files and state.pt) is there with
    the size and CRC-32 it was written with."""
    path = os.fspath(path)
    where = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.isfile(where):
        raise UsageError(
            f"checkpoint {path}: incomplete or damaged (no {CHECKSUMS_FILE}: not a whole ddpkit checkpoint)"
        )
    try:
        with open(where) as f:
            files = json.load(f)["files"]
        listed = {
            name: (int(entry["size"]), int(entry["crc32"]))
            for name, entry in files.items()
            if os.path.basename(name) == name and name not in ("", ".", "..")
        }
    except Exception:  # noqa: BLE001 - garbage fails anywhere: it is damage either way
        raise UsageError(f"checkpoint {path}: damaged ({CHECKSUMS_FILE} is not readable)") from None
    present = {name for name in os.listdir(path) if name in (METADATA_FILE, STATE_FILE) or DATA_FILE.fullmatch(name)}
    unlisted = sorted(present - set(listed))
    if unlisted or len(listed) != len(files):
        raise UsageError(
            f"checkpoint {path}: damaged ({CHECKSUMS_FILE} does not list {(unlisted or ['its files'])[0]})"
        )
    for name, (size, value) in sorted(listed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise UsageError(f"checkpoint {path}: incomplete ({name} is missing)")
        if os.path.getsize(file) != size or crc32(file) != value:
            raise UsageError(f"checkpoint {path}: damaged ({name} does not match the checksum written with it)")


def verified_here(path: str) -> None:
    """`verify` on rank 0, its verdict on every rank (collective): each rank reads only its
    own shards, so one reads them all to check them."""
    problem = None
    if dist.is_main():
        try:
            verify(path)
        except UsageError as err:
            problem = str(err)
    problem = dist.broadcast_object(problem)
    if problem:
        raise UsageError(problem)


def saved_shapes(metadata: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """The whole (unsharded) shapes of the tensors saved under `prefix` ('model'), by name."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    head = prefix + "."
    return {
        key[len(head) :]: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(head) and isinstance(entry, TensorStorageMetadata)
    }


def _reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP's own loads these with weights_only=False: numbers, strings and lists suffice.
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner()


def _dcp_state(entries: dict[str, Any], model: torch.nn.Module, flat: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Each entry's state in the helpers' form: each rank's own shards of an fsdp model, whole
    tensors of a replicated one; an optimizer's (of `model`) keyed by parameter name, flat for
    the keys in `flat` (an entry per parameter and setting, as a pipeline stage writes them: see
    `saved_flat`), else as one list of parameter groups; an EMA's own tensors (DTensors under fsdp), which DCP
    loads in place."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    def state(key: str, value: Any) -> Any:
        if isinstance(value, torch.nn.Module):
            return get_model_state_dict(value)
        if saved_in_shards(value):
            return value.state_dict()
        if not any(g["params"] for g in value.param_groups):  # none of its parameters on this pipeline stage
            return {}
        options = StateDictOptions(flatten_optimizer_state_dict=key in flat)
        with groups_with_parameters(value):
            return get_optimizer_state_dict(model, value, options=options)

    return {key: state(key, value) for key, value in entries.items()}


@contextlib.contextmanager
def groups_with_parameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, `optimizer` lists only its parameter groups that hold parameters: a pipeline
    stage may hold none of a group's, and torch's state-dict helpers read a group's first one.
    (Its flat entries are by parameter name: which groups are left out changes none.) Groups a
    load replaced are kept."""
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        replaced = iter(optimizer.param_groups)
        optimizer.param_groups = [next(replaced) if g["params"] else g for g in groups]


def saved_flat(metadata: Any, key: str) -> bool:
    """Whether the checkpoint's entry `key` (an optimizer's) was saved flat: an entry per
    parameter and setting (`state.<name>.exp_avg`, `param_groups.<name>.lr`), as `save` writes
    them, so that a checkpoint of any layout loads under any other, a pipeline's included: a
    pipeline stage's parameter groups hold its own parameters only, and of an entry every rank
    writes DCP keeps one rank's copy, so one list of groups would be one stage's. (Checkpoints
    written before pipelines came keep one list of groups: they load on every layout but a
    pipeline's.)"""
    nested = re.compile(rf"{re.escape(key)}\.param_groups\.\d+\.params")  # a group's list of parameter names
    return not any(nested.fullmatch(k) for k in metadata.state_dict_metadata)


def in_shards(value: Any) -> bool:
    """Whether a checkpoint entry goes through DCP (modules, optimizers and EMAs: sharded
    under fsdp) or into state.pt."""
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or saved_in_shards(value)


def saved_in_shards(value: Any) -> bool:
    """An entry whose state_dict is tensors shaped as its model's (DTensors under fsdp), saved
    and loaded in place beside the model's shards: an EMA (its class says `saved_in_shards`)."""
    return getattr(type(value), "saved_in_shards", False) is True


class Pending:
    """A checkpoint being written in the background: `wait()` until it is complete and, on rank
    0, renamed into place (raising what went wrong). Rank 0 renames it as soon as every rank's
    write is done, in the thread that finished the write."""

    def __init__(
        self, future: Future, path: str, tmp: str, placed: threading.Event | None, kept: list[OSError] | None = None
    ) -> None:
        self.future, self.path, self.tmp, self.placed = future, path, tmp, placed
        self.kept = kept if kept is not None else []  # this rank's write errors (see _writer)
        self.error: BaseException | None = None  # what went wrong putting it in place (rank 0)

    def done(self) -> bool:
        return self.future.done() and (self.placed is None or self.placed.is_set())

    def wait(self, timeout: float | None = None) -> None:
        """Until the checkpoint is complete; TimeoutError after `timeout` seconds."""
        try:
            self.future.result(timeout)
        except (TimeoutError, FutureTimeout):  # one class from Python 3.11 on
            raise TimeoutError(f"checkpoint {self.path}: not written within {timeout} s") from None
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if self.placed is not None:  # rank 0's callback removes the partial write: let it end first
                self.placed.wait(timeout)
            raise _write_error(err, self.path, self.kept, "the background write") from None
        if self.placed is not None and not self.placed.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path}: not renamed into place within {timeout} s")
        if self.error is not None:
            raise _write_error(self.error, self.path, self.kept, "the background write") from None

    def abandon(self) -> None:
        """Remove what the write has put on disk so far: a checkpoint finishes or vanishes."""
        remove(self.tmp)


_lock = threading.Lock()


def save(
    path: str | os.PathLike,
    entries: dict[str, Any],
    model: torch.nn.Module,
    rest: dict[str, Any],
    background: bool = False,
    on_complete: Callable[[], None] | None = None,
) -> Pending | None:
    """Write a checkpoint directory at `path`: the shards of `entries` (the bare `model` and
    its optimizers, by key) from every rank, `rest` (already in its saved form) from rank 0.
    Collective.

    With `background`, DCP copies this rank's shards to memory and writes them from a thread;
    training goes on, and the returned `Pending` completes when every rank's write is done.
    Rank 0 then renames the directory into place and calls `on_complete`."""
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    tmp = dist.broadcast_object(os.path.join(parent, f"{TEMP_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex[:8]}"))
    if dist.is_main():
        os.makedirs(tmp, exist_ok=True)  # DCP's writer on another rank may have made it already
        _save_rest(os.path.join(tmp, STATE_FILE), rest)
    # Buffers (BatchNorm's running statistics) are replicated, and DCP saves one rank's copy of
    # a replicated tensor, not always rank 0's: make every rank's rank 0's, which the next
    # training forward would broadcast anyway (see strategy.fsdp), so a resume is bit-identical.
    if whole_shapes(model) is None:  # (a pipeline stage's buffers are its own)
        dist.broadcast_tensors(list(model.buffers()))
    state = _dcp_state(entries, model, frozenset(entries))  # optimizers flat (see saved_flat)
    writer = _writer(tmp)
    no_dist = dist.world_size() == 1
    if not background:
        try:
            with _one_process_quiet():
                dcp.save(state, storage_writer=writer, no_dist=no_dist)
        except BaseException as err:
            remove(tmp)
            raise _write_error(err, path, writer.kept) from None
        if dist.is_main():
            try:
                write_checksums(tmp)  # every rank's shards are written once dcp.save returns here
            except BaseException as err:
                remove(tmp)
                raise _write_error(err, path, []) from None
            _put_in_place(tmp, path)
            if on_complete is not None:
                on_complete()
        dist.wait_for_main()
        return None
    group = None if no_dist else dist.background_group()
    future = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
    pending = Pending(future, path, tmp, threading.Event() if dist.is_main() else None, writer.kept)
    if dist.is_main():

        def finish(done: Future) -> None:
            try:
                if done.exception() is None:
                    with _lock:
                        write_checksums(tmp)  # in DCP's writing thread: training goes on meanwhile
                        _put_in_place(tmp, path)
                        if on_complete is not None:
                            on_complete()
                else:
                    remove(tmp)
            except BaseException as err:  # noqa: BLE001 - a callback's exception would be lost: wait() raises it
                pending.error = err
                remove(tmp)
            finally:
                pending.placed.set()

        future.add_done_callback(finish)
    return pending


class _KeptErrors:
    """A stream DCP writes a shard into, keeping the OSError a write raised: torch's zip writer
    turns it into "[enforce fail at inline_container.cc] unexpected pos", which says neither
    that the disk is full nor which file."""

    def __init__(self, stream: Any, kept: list[OSError]) -> None:
        self._stream, self._kept = stream, kept

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as err:
            self._kept.append(err)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _writer(folder: str) -> Any:
    """DCP's FileSystemWriter into `folder`, whose streams keep their write errors (`.kept`),
    and whose writes raise a full disk as the OSError it is, not as torch's zip writer's
    RuntimeError: DCP then hands that OSError to every rank in its CheckpointException, so each
    one, not only the rank whose write failed, can say the disk is full."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    kept: list[OSError] = []

    class Keeping(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                yield _KeptErrors(stream, kept) if "w" in mode or "a" in mode else stream

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except RuntimeError:
                full = [e for e in kept if e.errno in FULL_DISK]
                if full:
                    raise OSError(full[0].errno, os.strerror(full[0].errno), full[0].filename) from None
                raise

    writer = Writer(folder)
    writer.fs, writer.kept = Keeping(), kept
    return writer


def _write_error(err: BaseException, path: str, kept: list[OSError], how: str = "the write") -> BaseException:
    """The OSError a failed checkpoint write raises: a full disk (kept by this rank's streams,
    or among any rank's failures DCP gathered) as OSError(ENOSPC or EDQUOT, ..., path), which
    the trainer reports in its one line naming the intact checkpoint; anything else as one line
    of what went wrong."""
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return err
    gathered = [
        pair[0] if isinstance(pair, tuple) else pair for pair in (getattr(err, "failures", None) or {}).values()
    ]
    full = [e for e in [*kept, err, *gathered] if isinstance(e, OSError) and e.errno in FULL_DISK]
    if full:
        return OSError(full[0].errno, os.strerror(full[0].errno), path)
    if isinstance(err, OSError):
        return err
    return OSError(f"checkpoint {path}: {how} failed: {_first_line(err)}")


def _save_rest(where: str, rest: dict[str, Any]) -> None:
    save_file(where, rest)


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns, on every save and load, that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


REPLACED = re.compile(re.escape(TEMP_PREFIX) + r"old-(.+)-[0-9a-f]{8}")  # a directory being replaced


def _put_in_place(tmp: str, path: str) -> None:
    """Rename the finished directory `tmp` to `path`. A directory cannot be renamed over another
    one, so an older one there is first renamed aside, under a name that says whose it is: a crash
    between the two renames leaves it there, and `recover_replaced` puts it back."""
    old = None
    if os.path.lexists(path):
        old = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}old-{os.path.basename(path)}-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        remove(old)


def recover_replaced(folder: str) -> list[str]:
    """Put back each checkpoint directory that a crash left renamed aside while it was being
    replaced (see `_put_in_place`), where nothing has taken its name since: the names restored.
    Only where no write of ours can be under way (a run holds the folder's lock, or is about to)."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    restored = []
    for name in names:
        m = REPLACED.fullmatch(name)
        if m and not os.path.lexists(os.path.join(folder, m[1])):
            os.rename(os.path.join(folder, name), os.path.join(folder, m[1]))
            restored.append(m[1])
    if restored:
        _fsync_dir(folder)
    return restored


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    # DCP's CheckpointException lists each rank's traceback: keep the innermost error's line.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    return (errors[-1] if errors else lines[0] if lines else type(err).__name__)[:300]


def _load_failure(err: BaseException) -> str:
    """Why DCP's load failed, in a few words. torch's weights-only unpickler explains how to load
    the entry unsafely; that advice is never relayed: the global it refused is named instead."""
    text = str(err)
    if "Weights only load failed" not in text:
        return f"damaged, does not load ({_first_line(err)})"
    refused = [line.strip() for line in text.splitlines() if "GLOBAL" in line]
    what = refused[0][:200] if refused else "an entry is not made of tensors and plain values"
    return f"refused, loading it would run code ({what})"


def read_rest(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint directory's state.pt (everything but model and optimizer), checked."""
    path = os.fspath(path)
    where = os.path.join(path, STATE_FILE)
    if not os.path.isfile(where):
        raise UsageError(f"checkpoint {path}: incomplete (no {STATE_FILE})")
    try:
        rest = load_file(where)
    except UsageError as err:
        raise UsageError(str(err).replace(f"checkpoint {where}", f"checkpoint {path}: {STATE_FILE}")) from None
    if not isinstance(rest, dict):
        raise UsageError(f"checkpoint {path}: damaged ({STATE_FILE} is not a dict)")
    return rest


def load(path: str | os.PathLike, targets: dict[str, Any], model: torch.nn.Module | None) -> dict[str, Any]:
    """Load the directory's entries into `targets` (the bare `model` and its optimizers, by key;
    fsdp: each rank reads its own shards, whatever the world size that wrote them; replicated:
    every rank reads the whole tensors). Collective under a process group. Returns state.pt's
    entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    path = os.fspath(path)
    metadata = read_metadata(path)
    rest = read_rest(path)
    verified_here(path)
    if not targets:
        return rest
    flat = frozenset(key for key in targets if saved_flat(metadata, key))
    if whole_shapes(model) is not None and any(key not in flat and is_optimizer(t) for key, t in targets.items()):
        raise UsageError(
            f"checkpoint {path}: its optimizer state is one list of every parameter, which a pipeline stage "
            "cannot take its share of; resume it on another layout first (its next checkpoint loads under pp)"
        )
    state = _dcp_state(targets, model, flat)
    _check_keys(path, metadata, state, targets)
    try:
        with _one_process_quiet():
            dcp.load(state, storage_reader=_reader(path), planner=_planner(), no_dist=dist.world_size() == 1)
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(f"checkpoint {path}: {_load_failure(err)}") from None
    for key, target in targets.items():
        if isinstance(target, torch.nn.Module):
            set_model_state_dict(target, state[key])
        elif saved_in_shards(target):
            target.load_state_dict(state[key])
        elif any(g["params"] for g in target.param_groups):  # (none on this pipeline stage: nothing to load)
            options = StateDictOptions(flatten_optimizer_state_dict=key in flat)
            with groups_with_parameters(target):
                set_optimizer_state_dict(model, target, state[key], options=options)
    return rest


def is_optimizer(value: Any) -> bool:
    return not isinstance(value, torch.nn.Module) and not saved_in_shards(value)


def _check_keys(path: str, metadata: Any, state: dict[str, Any], targets: dict[str, Any]) -> None:
    """Refuse, in one line, a checkpoint whose model does not fit (rather than DCP's per-rank
    tracebacks, or a hang when ranks disagree)."""
    saved_keys = metadata.state_dict_metadata
    for key, target in targets.items():
        if not any(k.startswith(key + ".") for k in saved_keys):
            have = sorted({k.split(".")[0] for k in saved_keys})
            raise KeyError(f"checkpoint {path} has no entry {key!r}; it has {have}")
        if isinstance(target, torch.nn.Module):
            want = whole_shapes(target) or {
                name: tuple(t.shape) for name, t in state[key].items() if isinstance(t, torch.Tensor)
            }
            problem = shape_problem(saved_shapes(metadata, key), want)
            if problem:
                raise UsageError(f"checkpoint {path}: its weights do not fit this model ({problem})")


def whole_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]] | None:
    """The whole model's state shapes where `model` holds a part of it: a pipeline stage (see
    ddpkit.strategy.pp), whose own state is its share of a checkpoint's entries."""
    stage = getattr(model, "_ddpkit_stage", None)
    return None if stage is None else stage.shapes


def shape_problem(saved: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> str | None:
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    if missing:
        return f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    if unexpected:
        return f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"
    for name in want:
        if saved[name] != want[name]:
            return f"{name} is {list(saved[name])} in the checkpoint, {list(want[name])} here"
    return None
