"""`core.stack`: work started in a chunk of Python's frame stack of its own, wherever its caller
stands."""

from __future__ import annotations

import resource
import sys

import pytest

from ddpkit.core.stack import on_fresh_stack

CALLS = 2000
# Depths to try: 200 frames of `_faults_of_calls` (about 128 bytes each on CPython 3.11) span
# more than a chunk (16 KiB) and less than the room a fresh stack starts with (about 40 KiB).
DEPTHS = range(200)


def _leaf(a=0, b=0, c=0, d=0, e=0, f=0, g=0, h=0):
    x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = x8 = x9 = a  # a frame of some 30 slots
    return x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7 + x8 + x9 + b + c + d + e + f + g + h


def _faults_of_calls(depth: int) -> int:
    """The page faults of CALLS calls of `_leaf`, made `depth` frames below this one."""
    if depth:
        return _faults_of_calls(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        _leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.unit
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10's frames are objects of their own: no chunks")
def test_calls_across_a_chunks_end_map_a_page_each_time_but_not_on_a_fresh_stack():
    # Somewhere within a chunk's length (16 KiB, some 130 of these frames) of here, each call of
    # `_leaf` starts a chunk that its return gives back: a fault per call at least.
    faults = {depth: _faults_of_calls(depth) for depth in DEPTHS}
    crossing = [depth for depth, n in faults.items() if n >= CALLS]
    assert crossing, f"no depth where calls cross a chunk's end: {sorted(faults.values())[-5:]}"
    # The same calls at the same depths below the work's start: it starts at the foot of a
    # chunk with some 40 KiB to go, and none of them reaches its end.
    fresh = {depth: on_fresh_stack(_faults_of_calls, depth) for depth in crossing}
    assert max(fresh.values()) < CALLS // 20, fresh


@pytest.mark.unit
def test_the_work_gets_its_arguments_and_gives_its_result_and_exceptions_back():
    assert on_fresh_stack(lambda a, b=0, *, c: (a, b, c), 1, c=3) == (1, 0, 3)
    with pytest.raises(KeyError, match="gone"):
        on_fresh_stack({}.__getitem__, "gone")


def worst_faults() -> int:
    """The most page faults CALLS calls of `_leaf` make at any of DEPTHS."""
    return max(_faults_of_calls(depth) for depth in DEPTHS)


@pytest.mark.distributed
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10's frames are objects of their own: no chunks")
def test_a_forked_worker_starts_its_function_on_a_fresh_stack():
    # Forked from wherever the launch was called (here, under pytest), the worker's function
    # starts at the foot of a chunk of its own: none of DEPTHS crosses its end.
    import ddpkit

    assert max(ddpkit.launch(worst_faults, nproc=2, device="cpu").values()) < CALLS // 20
