"""Streaming data: an IterableDataset read as one global stream, the same on any world size.

Global batch k of an epoch is samples [k*B, (k+1)*B) of the stream. Every rank reads the
stream itself, from the start (no collective, no rank-0 broadcast), keeps its contiguous share
of each global batch (`share()`, as the map-style `GlobalBatchSampler` cuts it) and drops the
rest. So step k sees the same samples on any number of processes, and a run resumes on any
number from the global batches already handed out (`position`), as `DistributedLoader` does.

What it asks of the dataset: the stream must be deterministic, the same samples in the same
order on every rank and on every pass over one epoch (`set_epoch(epoch)` is called before each
pass when the dataset has it: shuffle there, seeded by the epoch). The ranks agree on where an
epoch ends only because they read the same stream.

What it costs: each rank reads every sample, including the other ranks' shares. Two ways to
make that cheap: yield cheap records (paths, bytes) and decode in `collate_fn`, which runs on
this rank's share only; and give the dataset `iter_from(start)`, an iterator over the current
epoch's stream from sample `start` on, which a resumed pass uses instead of reading the first
`start` samples and dropping them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from ..core import checks, dist
from ..core.tree import empty_like_batch
from ..errors import RunError, UsageError
from .loader import hand_out, move
from .samplers import GlobalBatchSampler, MicroBatch, check_global_batch

# Why the ranks' streams must end at the same sample.
_SAME_STREAM = (
    "an IterableDataset must yield the same samples on every rank (ddpkit gives each rank its share of "
    "the one stream; do not split it by rank yourself)"
)
_ends: dict[str, int] = {}  # ends of streams compared between ranks by this process, by what was compared


class _Counted:
    """An iterator that counts what it hands out."""

    def __init__(self, it: Iterator[Any]):
        self.it, self.n = it, 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        item = next(self.it)
        self.n += 1
        return item


class StreamLoader:
    """This rank's training micro-batches of one global stream, one epoch per pass, resumable
    at any optimizer step.

    The same protocol as `DistributedLoader`: `epoch` (being or next to be read), `position`
    (global batches of it already handed out), `current` (the MicroBatch last handed out) and
    `on_batch` (set by the Runtime), `state_dict()` / `load_state_dict()`. The end of the
    stream ends the epoch; a last global batch shorter than B is split as map-style splits it
    (a rank may get an empty share) unless `drop_last`. `steps_per_epoch` and `len()` come
    from `len(dataset)` when the dataset has one; otherwise they are unknown (None, TypeError).
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        global_batch: int,
        world_size: int,
        rank: int,
        device: torch.device,
        *,
        drop_last: bool = False,
        micro_batch_size: int | None = None,
        lockstep: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        channels_last: bool = False,
    ):
        check_global_batch(global_batch, world_size)
        if micro_batch_size is not None:
            checks.positive("--micro-batch-size", micro_batch_size)
        self.dataset, self.global_batch, self.world_size, self.rank = dataset, global_batch, world_size, rank
        self.device, self.drop_last, self.micro, self.lockstep = device, drop_last, micro_batch_size, lockstep
        self.collate_fn = collate_fn or default_collate
        self.channels_last = channels_last
        self.epoch = self.position = 0
        self._loaded = False  # state loaded and no pass since (see __iter__)
        self.current: MicroBatch | None = None
        self.on_batch: Any = None  # set by the Runtime: told of every micro-batch
        self.generator = None  # no DataLoader workers to seed (DistributedLoader has one)

    # -- what is known up front ------------------------------------------------------------
    def _sized(self) -> GlobalBatchSampler | None:
        """The map-style sampler of a stream of len(dataset) samples, when it has a length."""
        try:
            length = len(self.dataset)
        except TypeError:
            return None
        sampler = GlobalBatchSampler(
            length,
            self.global_batch,
            self.world_size,
            self.rank,
            shuffle=False,
            drop_last=self.drop_last,
            micro_batch_size=self.micro,
            lockstep=self.lockstep,
        )
        sampler.set_epoch(self.epoch, self.position)
        return sampler

    @property
    def steps_per_epoch(self) -> int | None:
        """Global batches per epoch from len(dataset); None when the dataset has no length."""
        sized = self._sized()
        return None if sized is None else sized.steps_per_epoch

    def __len__(self) -> int:
        """Micro-batches the next pass yields, from len(dataset); TypeError without one."""
        sized = self._sized()
        if sized is None:
            raise TypeError(
                f"a stream has no length: {type(self.dataset).__name__} defines no __len__ "
                "(steps_per_epoch is None; the end of the stream ends each epoch)"
            )
        return len(sized)

    # -- reading -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        loaded, self._loaded = self._loaded, False
        resumed = self.position > 0
        try:
            read = yield from self._rest_of_epoch()
            if not read and resumed and not loaded:
                # Every batch of that epoch was handed out by an earlier pass, left after its last
                # step: this pass reads the next epoch, as DistributedLoader's does. (Loaded from a
                # checkpoint at that point instead, this pass was what was left of it: nothing.)
                yield from self._rest_of_epoch()
        finally:
            self.current = None  # the pass ended, or was left: no micro-batch is current any more
            if self.on_batch is not None:
                self.on_batch(self)

    def _rest_of_epoch(self) -> Generator[Any, None, bool]:
        """This rank's micro-batches from global batch `position` to the end of the stream, then
        on to the next epoch; returns whether the stream had any sample left."""
        read, start, counted = False, self.position * self.global_batch, _Counted(self._open())
        for samples in self._global_batches(counted):
            read = True
            yield from hand_out(self, self._micro_batches(samples))
        self._check_same_end(start + counted.n)
        self.epoch, self.position = self.epoch + 1, 0
        return read

    def _check_same_end(self, end: int) -> None:
        """The ranks compare where the epoch's stream ended, through the job's store: a stream
        that ends sooner on one rank (a dataset that reads a rank's own file, or splits itself
        by rank) would otherwise leave that rank out of the others' next collective, and the
        others be blamed for the hang. The rank whose stream ended first says so (RunError); the
        others go on, and fail as its peers when it stops."""

        # Named by what every rank's loader of this stream shares, and how many ends of such a
        # loader this process has seen: not by the order loaders were made, which may differ.
        what = f"{type(self.dataset).__qualname__}/{self.global_batch}/{self.epoch}"
        _ends[what] = seen = _ends.get(what, 0) + 1
        ends = dist.compare_everywhere(f"stream-end/{what}/{seen}", end)
        if ends is None:
            return
        # (`ends` is keyed by the job's ranks, every process of it: tensor-parallel ranks, which
        # share a data rank, each read the stream too)
        if len(ends) < dist.world_size():  # the others are still reading: inside a step without this rank
            missing = sorted(set(range(dist.world_size())) - set(ends))
            raise RunError(
                f"rank {dist.rank()}'s stream ended after {end} samples of epoch {self.epoch}, while rank(s) "
                f"{', '.join(map(str, missing))} did not reach the end of theirs in "
                f"{dist.compare_wait_s():.0f} s (they read on past it, or are that far behind): {_SAME_STREAM}"
            )
        shortest = min(ends.values())
        if end == shortest:
            others = ", ".join(f"rank {r}'s after {e}" for r, e in ends.items() if e != shortest)
            raise RunError(
                f"rank {dist.rank()}'s stream ended after {end} samples of epoch {self.epoch}, {others}: {_SAME_STREAM}"
            )

    def _open(self) -> Iterator[Any]:
        """The epoch's stream from global batch `position` on."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        start = self.position * self.global_batch
        iter_from = getattr(self.dataset, "iter_from", None)
        if start and callable(iter_from):
            return iter(iter_from(start))
        return itertools.islice(iter(self.dataset), start, None)

    def _global_batches(self, stream: Iterator[Any]) -> Iterator[list[Any]]:
        # Each rank holds one whole global batch of samples (as read) while it cuts its share:
        # the share of a last, shorter batch depends on that batch's length.
        while samples := list(itertools.islice(stream, self.global_batch)):
            if self.drop_last and len(samples) < self.global_batch:
                return
            yield samples

    def _micro_batches(self, samples: list[Any]) -> Iterator[tuple[Any, MicroBatch]]:
        """This rank's micro-batches of one global batch, cut by the map-style sampler itself
        (shares, micro-batches, lockstep padding), collated and on the device."""
        cut = GlobalBatchSampler(
            len(samples),
            self.global_batch,
            self.world_size,
            self.rank,
            shuffle=False,
            micro_batch_size=self.micro,
            lockstep=self.lockstep,
        )
        for start, stop, info in cut.spans():
            batch = self.collate_fn(samples[start:stop]) if stop > start else self._empty(samples[0])
            yield move(batch, self.device, self.channels_last), info

    def _empty(self, example: Any) -> Any:
        """A batch of no samples, shaped like one of `example` (an empty share still runs the
        forward and backward, so DDP's reduction runs on every rank)."""
        return empty_like_batch(self.collate_fn([example]))

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Whether `position` is the end of its epoch is known only once the stream is read
        # there: the next pass finds out (see __iter__).
        self.epoch, self.position = int(state["epoch"]), int(state.get("position", 0))
        self._loaded = True


def stream_loader(
    dataset: Iterable[Any],
    global_batch: int,
    *,
    shuffle: bool | None = None,
    seed: int | None = None,
    num_workers: int | None = None,
    resident: bool | None = None,
    **options: Any,
) -> StreamLoader:
    """A StreamLoader of `options` (StreamLoader's own arguments); refuses the map-style
    options a stream cannot honour (given, they would promise an order, workers or a device
    copy that it does not make)."""
    refused = {
        "shuffle=True": shuffle,
        "seed": seed is not None,
        "num_workers > 0": bool(num_workers),
        "resident=True": resident,
    }
    for option, given in refused.items():
        if given:
            raise UsageError(
                f"{option} does not apply to a stream ({type(dataset).__name__} is an IterableDataset): it is read "
                "in its own order, in this process; shuffle in the dataset, seeded by its set_epoch(epoch)"
            )
    return StreamLoader(dataset, global_batch, **options)  # world_size, rank, device and the rest
