"""`samplers`: evaluation shards partition the set exactly, and a global batch's samples do not
depend on the number of ranks or micro-batches, nor on a resume mid-epoch."""

from __future__ import annotations

import itertools
import math

import pytest

from ddpkit import data

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n,world", [(10, 3), (1, 4), (7, 7), (359, 2)])
def test_shard_sampler_partitions_exactly(n, world):
    seen = [i for r in range(world) for i in data.ShardSampler(n, world, r)]
    assert sorted(seen) == list(range(n))
    assert sum(len(data.ShardSampler(n, world, r)) for r in range(world)) == n


def test_global_batch_shares():
    with pytest.raises(ValueError, match="smaller than the 4 processes"):
        data.check_global_batch(3, 4)
    assert [data.share(64, 3, r) for r in range(3)] == [(0, 22), (22, 21), (43, 21)]
    assert [data.share(2, 3, r) for r in range(3)] == [(0, 1), (1, 1), (2, 0)]  # an empty share is allowed


@pytest.mark.parametrize("n,batch,micro", [(50, 8, None), (50, 7, 2), (10, 4, 3), (5, 5, None), (11, 10, 1)])
def test_global_order_does_not_depend_on_world_size(n, batch, micro):
    """Step k's samples, over all ranks and micro-batches, are the same for 1, 2 and 3 ranks."""

    def steps(world):
        out = {}
        for rank in range(world):
            s = data.GlobalBatchSampler(n, batch, world, rank, seed=3, micro_batch_size=micro)
            s.set_epoch(1)
            step = 0
            for indices, info in s.plan():
                out.setdefault(step, []).extend(indices)
                assert info.step_size == len(out[step]) or not info.last or world > 1
                if micro:
                    assert len(indices) <= micro
                step += info.last
        return {k: sorted(v) for k, v in out.items()}

    one = steps(1)
    assert sorted(i for v in one.values() for i in v) == list(range(n))  # each sample once per epoch
    assert steps(2) == one and steps(3) == one


def test_resuming_mid_epoch_yields_exactly_the_rest():
    full = data.GlobalBatchSampler(30, 4, 2, 1, seed=0)
    full.set_epoch(2)
    rest = data.GlobalBatchSampler(30, 4, 3, 1, seed=0)  # resumed on another world size
    rest.set_epoch(2, start_step=5)
    one = data.GlobalBatchSampler(30, 4, 1, 0, seed=0)
    one.set_epoch(2, start_step=5)
    assert sum((idx for idx, _ in one.plan()), []) == full.order()[20:].tolist()
    assert len(list(rest.plan())) == full.steps_per_epoch - 5


def per_step(infos: list) -> list[list[int]]:
    """Micro-batch sizes, step by step."""
    steps, current = [], []
    for info in infos:
        current.append(info.size)
        if info.last:
            steps.append(current)
            current = []
    return steps


@pytest.mark.unit
@pytest.mark.parametrize("n,batch,micro,world", [(40, 10, 3, 3), (40, 7, 3, 2), (9, 5, 1, 3), (11, 10, 4, 4)])
def test_lockstep_gives_every_rank_as_many_micro_batches_padding_with_empty_ones_first(n, batch, micro, world):
    # fsdp: every forward all-gathers, so no rank may run one forward fewer than another.
    counts = set()
    for rank in range(world):
        free = data.GlobalBatchSampler(n, batch, world, rank, shuffle=False, micro_batch_size=micro)
        locked = data.GlobalBatchSampler(n, batch, world, rank, shuffle=False, micro_batch_size=micro, lockstep=True)
        real = [(idx, info) for idx, info in locked.plan() if info.size]
        assert real == [(idx, info) for idx, info in free.plan() if info.size]  # same samples, weights, last
        steps = per_step([info for _, info in locked.plan()])
        counts.add(tuple(len(sizes) for sizes in steps))
        for sizes in steps:
            assert sizes == sorted(sizes, key=bool)  # empty ones first: the last one, which reduces, is real
    assert len(counts) == 1  # every rank runs as many micro-batches in every step


def _spans_step_by_step(s: data.GlobalBatchSampler) -> list[tuple[int, int, tuple]]:
    """What spans() promises, derived one global batch at a time from `share`, as plainly as it
    can be written: the reference for the sampler's per-pass layouts."""
    out = []
    for step in range(s.start_step, s.steps_per_epoch):
        first = step * s.global_batch
        batch_len = min(s.global_batch, s.length - first)
        offset, size = data.share(batch_len, s.world_size, s.rank)
        micro = s.micro or max(1, size)
        starts = list(range(first + offset, first + offset + size, micro)) or [first + offset]
        padding = 0
        if s.lockstep and s.micro:  # as many micro-batches as the largest share (rank 0's) needs
            largest = math.ceil(batch_len / s.world_size)
            padding = max(0, math.ceil(largest / s.micro) - len(starts))
        out += [(first + offset, first + offset, (0, batch_len, False))] * padding
        for i, start in enumerate(starts):
            stop = min(start + micro, first + offset + size)
            out.append((start, stop, (stop - start, batch_len, i == len(starts) - 1)))
    return out


def test_spans_made_from_shared_layouts_are_the_step_by_step_spans():
    """spans() cuts each full global batch alike from one layout per pass (itertools alone when
    a share is one micro-batch): the same spans as cutting every global batch on its own, for
    every rank, micro-batch size, lockstep, drop_last and resume position."""
    for length, batch, world in [(1, 1, 1), (7, 3, 2), (33, 8, 3), (64, 32, 1), (100, 10, 4), (5, 5, 4)]:
        for rank, micro, lockstep, drop_last, start_step in itertools.product(
            range(world), (None, 1, 3), (False, True), (False, True), (0, 1)
        ):
            s = data.GlobalBatchSampler(
                length, batch, world, rank, drop_last=drop_last, micro_batch_size=micro, lockstep=lockstep
            )
            s.set_epoch(1, start_step)
            got = [(a, b, (i.size, i.step_size, i.last)) for a, b, i in s.spans()]
            assert got == _spans_step_by_step(s), (length, batch, world, rank, micro, lockstep, drop_last, start_step)
