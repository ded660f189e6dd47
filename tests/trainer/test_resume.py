"""`resume`: `--resume auto` skips a damaged newest checkpoint, refuses a run it cannot continue
or a changed learning rate, and a fresh run will not reuse a folder with checkpoints; nothing
is lost either way."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.trainer.helpers import COMMON, max_diff, train

pytestmark = pytest.mark.cli


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(straight, tmp_path):
    out = tmp_path / "out"
    train(out, "--nproc", "2", "--max-steps", "30", "--checkpoint-every", "10", "--keep-checkpoints", "3")
    folder = out / "checkpoints"
    # every 10 steps and at the end of epoch 1 (step 23); the newest three kept
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s:08d}.pt" for s in (20, 23, 30)]
    newest = folder / "step-00000030.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn file
    (folder / ".tmp-abandoned.pt").write_bytes(b"half a write")  # a write that never finished
    resumed = train(out, "--nproc", "2", "--resume", "auto")
    assert "at step 23" in resumed["stdout"]
    assert max_diff(resumed["weights"], straight["weights"]) == 0.0  # 23 -> 46 replays exactly


@pytest.mark.parametrize(
    "change",
    [("--model", "mlp"), ("--batch-size", "32"), ("--seed", "1"), ("--epochs", "1")],
    ids=["model", "batch-size", "seed", "already-finished"],
)
def test_resume_auto_refuses_a_run_it_cannot_continue(tmp_path, change):
    # Starting afresh would overwrite the run's metrics and checkpoints: refuse, lose nothing.
    out = tmp_path / "out"
    train(out, "--nproc", "1", "--epochs", "1")
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    metrics = (out / "metrics.jsonl").read_bytes()
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto", *change)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "--resume auto" in line and (change[0] in line or "finished" in line)
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_a_fresh_run_will_not_reuse_a_folder_with_checkpoints(tmp_path):
    out = tmp_path / "out"
    train(out, "--nproc", "1", "--epochs", "1")
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out))  # forgot --resume auto
    assert proc.returncode == 2 and "--resume auto" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_resume_refuses_a_changed_learning_rate(tmp_path):
    out = tmp_path / "out"
    train(out, "--nproc", "1", "--max-steps", "30")
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto", "--lr", "0.01")
    assert proc.returncode == 2 and "--lr" in proc.stderr  # the saved optimizer state would override it
