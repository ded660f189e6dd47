"""`ddpkit train` runs for the trainer's tests, and how far apart their weights are."""

from __future__ import annotations

import json
import shutil

import torch

from tests.conftest import run_cli

# 46 optimizer steps (2 epochs of digits at global batch 64). Each step may differ between world
# sizes in the last float32 bit (the all-reduce sums in another order), and training amplifies
# such differences slowly: measured 9e-7 after 46 steps (1e-5 to 1e-4 after the default 230).
# atol 1e-5 is 10x the measurement; a wrong sample order or weighting differs by > 1e-2.
ATOL_46_STEPS = 1e-5


COMMON = ("train", "--epochs", "2", "--device", "cpu")

# 64 over 3 ranks is uneven (22/21/21); micro-batches of 8 make each rank accumulate.
THREE = ("--nproc", "3", "--micro-batch-size", "8")


def train(out, *extra: str) -> dict:
    return finished(out, run_cli(*COMMON, "--out", str(out), *extra))


def finished(out, proc) -> dict:
    """A run that must have succeeded: its results, weights, metrics.jsonl records and output."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {
        "results": json.loads((out / "results.json").read_text()),
        "records": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
        "weights": torch.load(out / "model.pt", weights_only=True),
        "stdout": proc.stdout,
        "stderr": proc.stderr,
    }


def copied(run, tmp_path):
    """A copy of a shared run's out directory (tests/trainer/conftest.py), to continue or damage."""
    shutil.copytree(run, tmp_path / "out")
    return tmp_path / "out"


def step_records(run: dict) -> list[tuple]:
    """The step records of a run: (step, epoch, loss, lr), in the order written."""
    return [(r["step"], r["epoch"], r["loss"], r["lr"]) for r in run["records"] if r["type"] == "step"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
