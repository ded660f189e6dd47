"""`ddpkit report` on two real runs (the shared `runs` fixture, tests/conftest.py): PNG, table
and JSON agree with the runs' results; a bad directory is a one-line error."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PNG_MAGIC, run_cli

pytestmark = pytest.mark.cli


@pytest.mark.slow
def test_report_on_two_runs(runs):
    root, (a, _), (b, _) = runs
    png, out_json = root / "X.png", root / "Y.json"
    proc = run_cli("report", str(a), str(b), "--out", str(png), "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    rows = json.loads(out_json.read_text())["runs"]
    assert [r["run"] for r in rows] == [str(a), str(b)]
    for row, run_dir in zip(rows, (a, b)):
        results = json.loads((run_dir / "results.json").read_text())
        assert row["test_accuracy"] == results["test_accuracy"]
        assert row["world_size"] == results["world_size"]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(str(run_dir) + " "))
        assert f"{results['test_accuracy']:.4f}" in line
    assert [r["world_size"] for r in rows] == [2, 1]


@pytest.mark.slow
def test_report_bad_dir_is_one_line(runs, tmp_path):
    _, (a, _), _ = runs
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "metrics.jsonl").write_text("")
    for bad in (tmp_path / "missing", tmp_path / "half"):
        proc = run_cli("report", str(a), str(bad), "--out", str(tmp_path / "r.png"))
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(bad) in lines[0], proc.stderr
        assert not (tmp_path / "r.png").exists()
