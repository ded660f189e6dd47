"""`ddpkit bench loader` as a real command at --quick size: both data paths hand out the same
batches, and the record says how much faster the resident one is."""

from __future__ import annotations

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import run_bench, run_cli

pytestmark = pytest.mark.cli


def test_loader(tmp_path):
    r = run_bench(tmp_path, "loader", "--samples", "1024", "--batch-size", "64")
    assert r["identical_batches"] == {"normalize": True, "crop+flip+normalize": True}
    assert r["image_shape"] == [1, 28, 28] and r["batch_size"] == 64 and r["dataset_samples"] == 1024
    assert set(r["samples_per_second"]) == {
        f"{path} / {pipeline}"
        for path in ("resident", "dataloader 0 workers", "dataloader 2 workers")
        for pipeline in ("normalize", "crop+flip+normalize")
    }
    assert all(positive_stats(s) for s in r["samples_per_second"].values())
    assert r["speedup"] == min(r["speedup_by_pipeline"].values()) > 0
    assert r["meets_target"] == (r["speedup"] >= r["target_speedup"])


def test_loader_bad_shape_is_one_line(tmp_path):
    proc = run_cli("bench", "loader", "--shape", "1,x", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shape must be positive integers like 3,32,32, got '1,x'" in lines[0]
    assert not (tmp_path / "r.json").exists()
