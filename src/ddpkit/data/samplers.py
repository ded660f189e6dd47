"""Which samples each rank reads: one global order per epoch, cut into global batches and
split over the ranks (training), and an exact split of the test set (evaluation).

Training batches come from `GlobalBatchSampler`, so step k sees the same samples on any
number of processes. Evaluation uses `ShardSampler`, which splits the test set over ranks
without padding, so every test sample is counted exactly once whatever the world size.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from ..core import checks
from ..errors import UsageError
from .images import augment_keys


class ShardSampler(Sampler[int]):
    """Indices rank, rank+world, rank+2*world, ... of the dataset, in order, with no padding.

    Ranks may get one sample more or less than each other; that is what makes evaluation exact
    (DistributedSampler instead repeats samples to even out the shards).
    """

    def __init__(self, length: int, world_size: int, rank: int, batch: int = 1):
        self.length, self.world_size, self.rank, self.batch = length, world_size, rank, batch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))

    def most_batches(self) -> int:
        """The batches of the rank with the most (rank 0): ranks differ by at most one."""
        return len(range(0, self.length, self.world_size * self.batch))

    def chunks(self, batch: int | None = None) -> list[tuple[int, int, int]]:
        """This rank's indices in batches of `batch` (default: the batch it was made with), as
        (start, stop, step) ranges."""
        batch = batch or self.batch
        stride = self.world_size * batch
        return [(s, min(s + stride, self.length), self.world_size) for s in range(self.rank, self.length, stride)]


def check_global_batch(global_batch: int, world_size: int, rank: str = "process", ranks: str = "processes") -> None:
    """A global batch needs at least one sample per process (per data rank, where tensor-parallel
    ranks share theirs: `rank`, `ranks` name them); it need not divide evenly."""
    if global_batch < world_size:
        raise UsageError(
            f"--batch-size {global_batch} is smaller than the {world_size} {ranks}; "
            f"the global batch needs at least one sample per {rank}"
        )


def share(batch_len: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, length) of `rank`'s contiguous slice of a global batch of `batch_len` samples:
    the first `batch_len % world_size` ranks take one sample more."""
    base, extra = divmod(batch_len, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class MicroBatch:
    """What the runtime needs to know about the micro-batch a loader just handed out.

    `tokens` and `step_tokens` are set when the dataset says how many tokens each sample's
    loss averages over (`token_counts`, see `GlobalBatchSampler`): then the loss of a batch is a
    mean over its tokens, and `count` and `step_count` are tokens; otherwise samples.
    """

    size: int  # samples in it, on this rank
    step_size: int  # samples in the whole global batch (all ranks, all micro-batches)
    last: bool  # the last micro-batch of this rank for this optimizer step
    tokens: int | None = None  # tokens in it, on this rank
    step_tokens: int | None = None  # tokens in the whole global batch
    start: int = 0  # its first sample's position in the global batch (what keys ddpkit.Dropout's masks)

    @property
    def count(self) -> int:
        """What this micro-batch's mean loss is a mean over: its tokens, or its samples."""
        return self.size if self.tokens is None else self.tokens

    @property
    def step_count(self) -> int:
        """The same over the whole global batch."""
        return self.step_size if self.step_tokens is None else self.step_tokens


Layout = tuple[tuple[int, int, MicroBatch], ...]  # a global batch's micro-batches on one rank


def shifted(layout: Layout, firsts: range) -> Iterator[tuple[int, int, MicroBatch]]:
    """The spans of `layout` (positions from a global batch's first sample) for global batches
    starting at each of `firsts`."""
    if len(layout) == 1:  # one micro-batch per step: ranges and a repeat, no Python code per step
        ((start, stop, info),) = layout
        return zip(_shift(firsts, start), _shift(firsts, stop), itertools.repeat(info))
    return ((first + start, first + stop, info) for first in firsts for start, stop, info in layout)


def _shift(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by, r.step)


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches, cut from one global order that ignores the world size.

    Epoch e's order is a permutation drawn from `seed + e`. Global batch k is samples
    [k*B, (k+1)*B) of it; each rank takes a contiguous slice (shares differ by at most one
    when B does not divide evenly) and splits it into micro-batches of at most
    `micro_batch_size`. So which samples form step k depends on the seed and the epoch only,
    and a run can stop after any step and continue on any number of processes.

    `token_counts` (one count per sample, such as `TextSet.token_counts`) makes each
    MicroBatch carry its tokens and its global batch's: every rank knows the whole global
    batch's indices, so each computes the step's total on its own, without a collective.
    """

    def __init__(
        self,
        length: int,
        global_batch: int,
        world_size: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        micro_batch_size: int | None = None,
        lockstep: bool = False,
        token_counts: torch.Tensor | None = None,
    ):
        check_global_batch(global_batch, world_size)
        if token_counts is not None and len(token_counts) != length:
            raise ValueError(f"token_counts has {len(token_counts)} entries for {length} samples")
        if micro_batch_size is not None:
            checks.positive("--micro-batch-size", micro_batch_size)
        self.length, self.global_batch, self.world_size, self.rank = length, global_batch, world_size, rank
        self.shuffle, self.seed, self.drop_last, self.micro = shuffle, seed, drop_last, micro_batch_size
        self.lockstep = lockstep  # every rank the same number of micro-batches per step (fsdp)
        self.token_counts = None if token_counts is None else torch.as_tensor(token_counts, device="cpu")
        self.epoch, self.start_step = 0, 0
        self.keys = False  # yield (index, augmentation key) pairs instead of indices

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.length, self.global_batch)
        return full + (rest > 0 and not self.drop_last)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.length)
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def spans(self) -> Iterator[tuple[int, int, MicroBatch]]:
        """(start, stop, MicroBatch): this rank's remaining micro-batches of the epoch, as
        positions [start, stop) in the epoch's global order."""
        return self._spans() if self.token_counts is None else self._token_spans()

    def _token_spans(self) -> Iterator[tuple[int, int, MicroBatch]]:
        counts = self.token_counts[self.order()]  # in the epoch's order: a global batch is a slice
        total = {}  # the tokens of the global batch that starts at position `first`
        for start, stop, info in self._spans():
            first = start - start % self.global_batch  # every span lies inside its global batch
            if first not in total:
                total = {first: int(counts[first : first + info.step_size].sum())}
            info = dataclasses.replace(info, tokens=int(counts[start:stop].sum()), step_tokens=total[first])
            yield start, stop, info

    def _spans(self) -> Iterator[tuple[int, int, MicroBatch]]:
        """Every full global batch is cut alike: its layout is made once per pass, its MicroBatch
        records shared (they are frozen), and when a rank's share is one micro-batch the spans
        come from itertools alone, with no Python code per step (the runtime's loader reads
        one per step)."""
        size, full = self.global_batch, self.length // self.global_batch  # full: batches of `size` samples
        plan = shifted(self._layout(size), range(self.start_step * size, full * size, size))
        if self.steps_per_epoch > max(full, self.start_step):  # a last, shorter global batch
            last = range(full * size, full * size + 1)
            plan = itertools.chain(plan, shifted(self._layout(self.length - full * size), last))
        return plan

    def _layout(self, batch_len: int) -> Layout:
        """This rank's micro-batches of a global batch of `batch_len` samples, as (start, stop,
        MicroBatch) with positions counted from the batch's first sample."""
        offset, size = share(batch_len, self.world_size, self.rank)
        micro = self.micro or max(1, size)
        # A rank whose share is empty (a last batch smaller than the world) still takes
        # one empty micro-batch: DDP needs every rank's backward to all-reduce.
        starts = list(range(offset, offset + size, micro)) or [offset]
        # Empty micro-batches first (never the last, which reduces): under lockstep every rank
        # runs as many forwards per step as the rank with the largest share.
        layout = [(offset, offset, MicroBatch(0, batch_len, False, start=offset))] * self._padding(
            batch_len, len(starts)
        )
        for i, start in enumerate(starts):
            stop = min(start + micro, offset + size)
            layout.append((start, stop, MicroBatch(stop - start, batch_len, i == len(starts) - 1, start=start)))
        return tuple(layout)

    def most_micro_batches(self) -> tuple[int, int]:
        """(micro-batches, samples in the largest) of the rank with the largest share of a full
        global batch: what a pipeline's schedule is built for (every step padded to it)."""
        largest = -(-self.global_batch // self.world_size)
        micro = self.micro or max(1, largest)
        return max(1, -(-largest // micro)), micro

    def _padding(self, batch_len: int, count: int) -> int:
        """Empty micro-batches this rank adds to its `count` for a global batch of `batch_len`."""
        if not (self.lockstep and self.micro):  # without micro-batches every rank runs one
            return 0
        largest = -(-batch_len // self.world_size)  # the first rank's share
        return max(0, -(-largest // self.micro) - count)

    def plan(self) -> Iterator[tuple[list[int], MicroBatch]]:
        """(indices, MicroBatch) for this rank's remaining micro-batches of the epoch."""
        order = self.order()
        for start, stop, info in self.spans():
            yield order[start:stop].tolist(), info

    def __iter__(self) -> Iterator[list[Any]]:
        if not self.keys:
            return (indices for indices, _ in self.plan())
        return self._keyed()

    def _keyed(self) -> Iterator[list[tuple[int, int]]]:
        # (index, augmentation key) pairs, for a dataset that augments per sample (ImageSet).
        order = self.order()
        for start, stop, _ in self.spans():
            keys = augment_keys(self.seed, self.epoch, torch.arange(start, stop))
            yield list(zip(order[start:stop].tolist(), keys.tolist()))

    def __len__(self) -> int:
        return sum(1 for _ in self._spans())
