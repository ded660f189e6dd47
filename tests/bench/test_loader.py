"""`ddpkit bench loader` as a real command at --quick size: both data paths hand out the same
batches, and the record says how much faster the resident one is."""

from __future__ import annotations

import json

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import PNG_MAGIC, run_bench, run_cli

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


def test_plot_goes_beside_the_json_and_nothing_under_the_current_directory(tmp_path):
    # Run from a checkout, the default benchmarks/results/ holds committed plots: --json alone
    # used to overwrite loader-cpu.png there.
    cwd = tmp_path / "checkout"
    committed = cwd / "benchmarks" / "results" / "loader-cpu.png"
    committed.parent.mkdir(parents=True)
    committed.write_bytes(b"the committed plot")
    flags = ("--device", "cpu", "--quick", "--repeats", "1", "--samples", "256", "--batch-size", "64")
    proc = run_cli("bench", "loader", *flags, "--json", "tmp/x.json", cwd=str(cwd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (cwd / "tmp" / "x.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((cwd / "tmp" / "x.json").read_text())["plot"] == "tmp/x.png"
    assert committed.read_bytes() == b"the committed plot"
    written = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*") if p.is_file())
    assert written == ["benchmarks/results/loader-cpu.png", "tmp/x.json", "tmp/x.png"]
