"""`ddpkit find-batch-size` end to end on 2 CPU processes (JSON, plot, the knee), and bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import run_cli

pytestmark = pytest.mark.cli


def test_cli_two_processes_json_png_and_the_knee(tmp_path):
    json_path, png = tmp_path / "fbs.json", tmp_path / "fbs.png"
    proc = run_cli(
        "find-batch-size",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--max-batch",
        "64",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--plateau",
        "0",
        "--json",
        str(json_path),
        "--plot",
        str(png),
        timeout=120,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    r = json.loads(json_path.read_text())
    assert r["world_size"] == 2 and r["criterion"] == "knee" and r["knee_fraction"] == 0.9
    assert [t["per_device_batch"] for t in r["trials"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(t["fits"] and t["global_batch"] == 2 * t["per_device_batch"] for t in r["trials"])
    best = max(t["samples_per_s"] for t in r["trials"])
    knee = min(t["per_device_batch"] for t in r["trials"] if t["samples_per_s"] >= 0.9 * best)
    assert r["per_device_batch"] == knee and r["global_batch"] == 2 * knee
    assert r["largest_fitting_per_device_batch"] == 64 and r["search_stopped_by"] == "--max-batch"
    assert r["versions"]["torch"] == torch.__version__ and r["device"] == "cpu"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"use --batch-size {2 * knee} (per device {knee})" in proc.stdout
    assert proc.stdout.count("per-device   global") == 1  # one table, from rank 0 only


def test_cli_fsdp_runs_the_sharded_step_on_every_process(tmp_path):
    json_path = tmp_path / "fbs.json"
    proc = run_cli(
        "find-batch-size",
        *("--strategy", "fsdp", "--nproc", "2", "--device", "cpu", "--model", "mlp"),
        *("--max-batch", "8", "--steps", "1", "--warmup", "0", "--plateau", "0", "--json", str(json_path)),
        timeout=120,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "2 x cpu fsdp" in proc.stdout
    r = json.loads(json_path.read_text())
    assert r["strategy"] == "fsdp" and r["world_size"] == 2
    assert [t["per_device_batch"] for t in r["trials"]] == [1, 2, 4, 8]
    assert all(t["fits"] and t["samples_per_s"] > 0 for t in r["trials"])


@pytest.mark.parametrize(
    "args",
    [
        ["--max-batch", "0"],
        ["--start", "100", "--max-batch", "10"],
        ["--model", "nope"],
        ["--data", "synthetic", "--synthetic-shape", "3,x"],
        ["--steps", "0"],
        ["--nproc", "two"],
        ["--plot", "curve.jpg"],
        ["--json", "/dev/null/r.json"],
    ],
    ids=["max-batch", "start", "model", "shape", "steps", "nproc", "plot", "json"],
)
def test_bad_input_exits_2_with_one_line(args, tmp_path):
    proc = run_cli("find-batch-size", "--device", "cpu", *args, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit find-batch-size: error:"), proc.stderr
    assert not os.listdir(tmp_path)  # nothing written
