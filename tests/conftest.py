"""Shared fixtures. Every test starts with no launcher/SLURM variables and no process group,
so one test's distributed state never leaks into the next."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def clean_dist_env(monkeypatch):
    for name in list(os.environ):
        if name in LAUNCH_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 240, env: dict | None = None, cwd: str | None = None,
            stdin: str | None = None, module: str = "ddpkit") -> subprocess.CompletedProcess:
    """Run `python -m ddpkit ARGS...` (or another module: `benchmarks` runs from the repository
    root) as a real subprocess; returns the completed process."""
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd, input=stdin)


def run_comparison(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGS...` from the repository root: the comparison benchmarks."""
    return run_cli(*args, timeout=timeout, cwd=ROOT, module="benchmarks")


@pytest.fixture
def cli():
    return run_cli


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(tmp_path, name: str, *flags: str, timeout: float = 300, comparison: bool = False) -> dict:
    """`ddpkit bench NAME --quick --repeats 1` (or `python -m benchmarks NAME ...` for a
    comparison) on CPU as a subprocess; checks the PNG and the record's metadata, returns the
    benchmark's result payload."""
    import json

    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    args = (name, "--device", "cpu", "--quick", "--repeats", "1", "--json", str(out_json), "--plot", str(out_png),
            *flags)
    proc = run_comparison(*args, timeout=timeout) if comparison else run_cli("bench", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = out_png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000, f"{out_png} is not a drawn PNG"
    record = json.loads(out_json.read_text())
    assert record["benchmark"] == name and record["device"] == "cpu" and record["versions"]["torch"]
    return record["result"]
