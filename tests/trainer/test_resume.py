"""`resume`: `--resume auto` skips a damaged newest checkpoint (saying so), refuses a run it
cannot continue, a changed learning rate, or a folder whose checkpoints are all damaged; a
checkpoint with wrong entries is one line and exit 2; and a fresh run will not reuse a folder
with checkpoints; nothing is lost either way."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli
from tests.trainer.helpers import COMMON, copied, max_diff, train

pytestmark = pytest.mark.cli


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(straight, stopped, tmp_path):
    out = copied(stopped(30)[0], tmp_path)  # --max-steps 30 --checkpoint-every 10 --keep-checkpoints 3
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
def test_resume_auto_refuses_a_run_it_cannot_continue(three_checkpoints, tmp_path, change):
    # Starting afresh would overwrite the run's metrics and checkpoints: refuse, lose nothing.
    out = copied(three_checkpoints, tmp_path)  # a finished one-epoch run on one process
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    metrics = (out / "metrics.jsonl").read_bytes()
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto", *change)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "--resume auto" in line and (change[0] in line or "finished" in line)
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_a_fresh_run_will_not_reuse_a_folder_with_checkpoints(three_checkpoints, tmp_path):
    out = copied(three_checkpoints, tmp_path)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out))  # forgot --resume auto
    assert proc.returncode == 2 and "--resume auto" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_resume_refuses_a_changed_learning_rate(three_checkpoints, tmp_path):
    out = copied(three_checkpoints, tmp_path)  # one epoch of the two asked for below: one left to train
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto", "--lr", "0.01")
    assert proc.returncode == 2 and "--lr" in proc.stderr  # the saved optimizer state would override it


def _copy(run, tmp_path):
    out = copied(run, tmp_path)
    return out, out / "checkpoints"


def test_resume_auto_names_each_checkpoint_it_skips_and_prunes_interrupted_writes(three_checkpoints, tmp_path):
    out, folder = _copy(three_checkpoints, tmp_path)
    newest = folder / "step-00000023.pt"
    newest.write_bytes(newest.read_bytes()[:5000])  # torn
    (folder / "step-00000020.pt").write_bytes(b"not a checkpoint at all")
    (folder / ".tmp-k2j4.pt").write_bytes(b"half a write")  # a crash mid-write left it
    (out / ".tmp-9x.json").write_text("{")
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipped" in line]
    assert len(warnings) == 2, proc.stderr
    assert "step-00000023.pt: not a readable PyTorch file" in warnings[0]
    assert "step-00000020.pt: not a readable PyTorch file" in warnings[1]
    assert "at step 15" in proc.stdout
    assert not (folder / ".tmp-k2j4.pt").exists() and not (out / ".tmp-9x.json").exists()


def test_resume_auto_exits_2_when_checkpoints_exist_and_none_is_usable(three_checkpoints, tmp_path):
    # Starting over from step 0 would silently throw the run's progress away.
    out, folder = _copy(three_checkpoints, tmp_path)
    for path in folder.iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    before = {p: p.read_bytes() for p in [*folder.iterdir(), out / "metrics.jsonl", out / "results.json"]}
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume auto: none of the 3 checkpoints" in lines[0], proc.stderr
    assert all(f"step-000000{s}.pt" in lines[0] for s in ("15", "20", "23"))
    assert {p: p.read_bytes() for p in before} == before


def _set(key, value):
    def change(state):
        state["run"][key] = value

    return change


def _drop(key):
    def change(state):
        del state["run"][key]

    return change


@pytest.mark.parametrize(
    "change, named",
    [
        (_set("epoch", "1"), "'epoch' is '1'"),  # a TypeError in the plan before
        (_set("rng", []), "0 random states for world size 1"),  # an IndexError in every worker
        (_drop("history"), "no 'history'"),  # a KeyError in every worker
        (_set("lr", torch.tensor([0.05, 0.05])), "'lr' is Tensor"),  # "ambiguous truth value"
    ],
    ids=["epoch-str", "rng-short", "no-history", "lr-tensor"],
)
def test_a_checkpoint_with_wrong_entries_is_one_line_and_exit_2_before_any_worker(
    three_checkpoints, tmp_path, change, named
):
    state = torch.load(three_checkpoints / "checkpoints" / "step-00000015.pt", weights_only=True)
    change(state)
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    out = tmp_path / "new"
    proc = run_cli(*COMMON, "--nproc", "2", "--out", str(out), "--resume", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--resume: checkpoint {path}: damaged" in lines[0] and named in lines[0], lines
    assert proc.stdout == "" and not out.exists()  # no worker started, nothing written
