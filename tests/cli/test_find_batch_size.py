"""`ddpkit find-batch-size` end to end on 2 CPU processes (JSON, plot, the knee), and bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.cli.argv_runner import run_batch
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


@pytest.mark.parametrize(
    "flags,header,strategy,mesh,sizes",
    [
        (("--strategy", "fsdp"), "2 x cpu fsdp", "fsdp", "dp=2", [1, 2, 4, 8]),
        # the mesh picks hsdp
        (("--mesh", "replicate=2,dp=1"), "2 x cpu hsdp on replicate=2,dp=1", "hsdp", "replicate=2,dp=1", [1, 2]),
        # a pipeline of gpt: a size is the one data rank's, cut into micro-batches; gpipe starts at 1
        (
            ("--model", "gpt", "--mesh", "pp=2", "--pp-schedule", "gpipe", "--seq-len", "16", "--gpt-width", "16")
            + ("--gpt-style", "llama", "--gpt-kv-heads", "2", "--gpt-hidden", "24"),  # Llama's shape, as train takes it
            "gpt (width 16, depth 4, heads 4, llama, kv heads 2, hidden 24) on sequences of 16 tokens (a vocabulary "
            "of 256), 2 x cpu pp on pp=2",
            "pp",
            "pp=2",
            [1, 2, 4],
        ),
    ],
    ids=["fsdp", "hsdp-mesh", "pp-gpt"],
)
def test_cli_a_sharded_strategy_runs_its_step_on_every_process(tmp_path, flags, header, strategy, mesh, sizes):
    json_path = tmp_path / "fbs.json"
    proc = run_cli(
        "find-batch-size",
        *flags,
        *("--nproc", "2", "--device", "cpu", *(() if "--model" in flags else ("--model", "mlp"))),
        *("--max-batch", str(sizes[-1])),
        *("--steps", "1", "--warmup", "0", "--plateau", "0", "--json", str(json_path)),
        timeout=120,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert header in proc.stdout
    r = json.loads(json_path.read_text())
    assert (r["strategy"], r["mesh"], r["world_size"]) == (strategy, mesh, 2)
    assert [t["per_device_batch"] for t in r["trials"]] == sizes
    assert all(t["fits"] and t["samples_per_s"] > 0 for t in r["trials"])
    ranks = 1 if strategy == "pp" else 2  # a pipeline's processes read the same samples
    assert r["data_ranks"] == ranks and all(t["global_batch"] == ranks * t["per_device_batch"] for t in r["trials"])
    if strategy == "pp":
        assert "the 2 processes form 1 data rank" in proc.stdout
        each = f"{r['per_device_batch']} per data rank, --mesh pp=2 --pp-schedule gpipe"  # what train needs too
        assert f"use --batch-size {r['global_batch']} ({each})" in proc.stdout


BAD_INPUT = {
    "mesh-size": ["--mesh", "replicate=3,dp=1", "--nproc", "2"],
    "mesh-name": ["--mesh", "cp=2", "--nproc", "2"],
    "tp-no-plan": ["--model", "cnn", "--mesh", "dp=1,tp=2", "--nproc", "2"],
    "tp-heads": ["--model", "gpt", "--mesh", "tp=3", "--nproc", "3"],
    "pp-stages": ["--model", "gpt", "--mesh", "pp=8", "--nproc", "8"],
    "pp-fp16": ["--model", "gpt", "--mesh", "pp=2", "--nproc", "2", "--precision", "fp16"],
    "pp-1f1b": ["--model", "gpt", "--mesh", "pp=4", "--nproc", "4", "--max-batch", "2"],
    "pp-schedule": ["--model", "gpt", "--mesh", "pp=2", "--nproc", "2", "--pp-schedule", "zb"],
    "text-image-model": ["--model", "cnn", "--data", "text"],
    "gpt-images": ["--model", "gpt", "--data", "digits"],
    "seq-len": ["--model", "gpt", "--seq-len", "0"],
    "gpt-width": ["--model", "gpt", "--gpt-width", "30"],
    "gpt-kv-heads": ["--model", "gpt", "--gpt-kv-heads", "3"],  # 4 query heads
    "gpt-style": ["--model", "gpt", "--gpt-style", "mistral"],
    "llama-odd-head": ["--model", "gpt", "--gpt-style", "llama", "--gpt-width", "20"],  # heads of 5 features
    "tp-kv-heads": ["--model", "gpt", "--gpt-kv-heads", "1", "--mesh", "dp=1,tp=2", "--nproc", "2"],
    "gpt-memory": ["--model", "gpt", "--seq-len", "100000000"],
    "tp-fp16": ["--model", "gpt", "--mesh", "dp=1,tp=2", "--nproc", "2", "--precision", "fp16"],
    "max-batch": ["--max-batch", "0"],
    "start": ["--start", "100", "--max-batch", "10"],
    "model": ["--model", "nope"],
    "shape": ["--data", "synthetic", "--synthetic-shape", "3,x"],
    "steps": ["--steps", "0"],
    "nproc": ["--nproc", "two"],
    "plot": ["--plot", "curve.jpg"],
    "json": ["--json", "/dev/null/r.json"],
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, dict]:
    """Each BAD_INPUT command line, in an empty folder of its own, run in one helper interpreter
    (tests/cli/argv_runner.py: they are all refused before any work starts): id -> its folder and
    outcome."""
    cases = {}
    for name, args in BAD_INPUT.items():
        cwd = tmp_path_factory.mktemp(f"bad-{name}")
        cases[name] = {"argv": ["find-batch-size", "--device", "cpu", *args], "cwd": str(cwd)}
    outcomes = run_batch(list(cases.values()))
    return {name: {**c, **r} for (name, c), r in zip(cases.items(), outcomes)}


@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(refused, name):
    r = refused[name]
    assert r["code"] == 2, r["stderr"]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit find-batch-size: error:"), r["stderr"]
    assert not os.listdir(r["cwd"])  # nothing written
    assert NAMED.get(name, "") in lines[0]


# what the line of some cases names: the flag to change
NAMED = {
    "gpt-kv-heads": "--gpt-kv-heads 3",
    "gpt-style": "--gpt-style must be one of gpt2, llama",
    "llama-odd-head": "each head's width (5) must be even",
    "tp-kv-heads": "its 4 heads, 1 key/value heads and 256 tokens must be multiples of 2",
}
