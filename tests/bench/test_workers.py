"""`ddpkit bench workers` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.cli


def test_workers(tmp_path):
    r = run_bench(tmp_path, "workers", "--samples", "256", "--batch-sizes", "32,64", "--image-size", "16")
    assert r["pin_memory"] == [False] and "n/a" in r["pin_memory_note"]
    assert {x["num_workers"] for x in r["results"]} >= {0, 1, 2, 4}
    assert {x["batch_size"] for x in r["results"]} == {32, 64}
    assert all(x["samples_per_second"]["median"] > 0 and x["first_batch_seconds"] > 0 for x in r["results"])
    best = r["best"]
    assert set(best) >= {"num_workers", "pin_memory", "samples_per_second"}
    assert any(x["num_workers"] == best["num_workers"] and x["batch_size"] == best["batch_size"] for x in r["results"])
    assert best["samples_per_second"] > 0 and best["pin_memory"] is False
