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


def _logged(path, losses: list[float]) -> None:
    """A Runtime's log_dir, written by a real Runtime's rt.log (one process)."""
    import ddpkit

    with ddpkit.Runtime(device="cpu", log_dir=str(path)) as rt:
        for step, loss in enumerate(losses):
            rt.log(step * 10, loss=loss, accuracy=1 - loss / 4, note="text is not plotted")


def test_report_on_runtime_log_dirs_plots_what_was_logged_against_the_step(tmp_path):
    # users of their own loop want the same report: their log_dir has metrics.jsonl and no results.json
    _logged(tmp_path / "a", [2.0, 1.0, 0.5])
    _logged(tmp_path / "b", [3.0, 1.5])
    png, out_json = tmp_path / "r.png", tmp_path / "r.json"
    proc = run_cli("report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png), "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes().startswith(PNG_MAGIC)
    rows = json.loads(out_json.read_text())["runs"]
    assert rows == [
        {"run": str(tmp_path / "a"), "last_step": 20, "last": {"loss": 0.5, "accuracy": 0.875}},
        {"run": str(tmp_path / "b"), "last_step": 10, "last": {"loss": 1.5, "accuracy": 0.625}},
    ]
    header, *lines = proc.stdout.splitlines()
    assert header.split() == ["run", "last", "step", "loss", "(last)", "accuracy", "(last)"]
    assert lines[0].split() == [str(tmp_path / "a"), "20", "0.5", "0.875"]
    # a directory with metrics.jsonl but no record of rt.log is refused in one line
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text('{"type": "something else"}\n')
    bad = run_cli("report", str(tmp_path / "c"), "--out", str(tmp_path / "c.png"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"ddpkit report: error: {tmp_path / 'c'}/metrics.jsonl: no records of rt.log (each a JSON object with a step)"
    ]


def test_report_on_a_log_dir_takes_any_metric_name_a_torn_last_line_and_a_last_value_that_is_not_finite(tmp_path):
    import math

    import ddpkit

    with ddpkit.Runtime(device="cpu", log_dir=str(tmp_path / "a")) as rt:
        rt.log(1, run=3, steps=300, type="eval", loss=0.5, flag=True)  # names the report uses itself
        rt.log(2, run=4, steps=301, type="eval", loss=math.inf)  # written as null: the run diverged
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.')  # torn: a run stopped by a full disk
    out_json = tmp_path / "r.json"
    proc = run_cli("report", str(tmp_path / "a"), "--out", str(tmp_path / "r.png"), "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out_json.read_text())["runs"]
    assert row["run"] == str(tmp_path / "a") and row["last_step"] == 2
    assert row["last"]["run"] == 4 and row["last"]["steps"] == 301
    assert row["last"]["loss"] is None or math.isnan(row["last"]["loss"])  # not the finite 0.5 before it
    assert "flag" not in row["last"] and "type" not in row["last"]  # not numbers
    # only text was logged: nothing to plot, said in one line
    with ddpkit.Runtime(device="cpu", log_dir=str(tmp_path / "t")) as rt:
        rt.log(1, note="text")
    bad = run_cli("report", str(tmp_path / "t"), "--out", str(tmp_path / "t.png"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"ddpkit report: error: {tmp_path / 't'}: no number was logged with rt.log, nothing to plot"
    ]
