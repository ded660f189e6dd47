"""`evaluation`: an odd-sized test set is counted exactly once over the ranks, and every rank
gets the one-process result."""

from __future__ import annotations

import pytest

import ddpkit
from tests import workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "strategy,nproc,n", [("ddp", 2, 37), ("ddp", 3, 37), ("ddp", 3, 1), ("fsdp", 3, 37), ("fsdp", 3, 1)]
)  # fsdp: ranks with a batch fewer (or none) run forwards on empty batches to keep in step
def test_odd_test_set_counted_exactly_once(strategy, nproc, n):
    out = ddpkit.launch(workers.evaluate_odd, n, strategy, nproc=nproc)
    reference = workers.evaluate_odd(n)  # one process, no sharding
    assert reference["samples"] == n
    assert sum(r["shard"] for r in out.values()) == n  # shards partition the set: no padding
    for r in out.values():
        assert r["samples"] == n
        assert r["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-6)
