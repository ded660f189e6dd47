"""`ddpkit train` end to end: the result does not depend on the number of processes, and a run
stopped at any step and resumed, on any number of processes, ends where an uninterrupted run ends."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli

# 46 optimizer steps (2 epochs of digits at global batch 64). Each step may differ between world
# sizes in the last float32 bit (the all-reduce sums in another order), and training amplifies
# such differences slowly: measured 9e-7 after 46 steps (1e-5 to 1e-4 after the default 230).
# atol 1e-5 is 10x the measurement; a wrong sample order or weighting differs by > 1e-2.
ATOL_46_STEPS = 1e-5
COMMON = ("train", "--epochs", "2", "--device", "cpu")


def _train(out, *extra: str) -> dict:
    proc = run_cli(*COMMON, "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {"results": json.loads((out / "results.json").read_text()),
            "weights": torch.load(out / "model.pt", weights_only=True), "stdout": proc.stdout}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2-process run every other run here is compared with."""
    return _train(tmp_path_factory.mktemp("straight") / "out", "--nproc", "2")


@pytest.mark.parametrize("extra", [("--nproc", "1"), ("--nproc", "3", "--micro-batch-size", "8")],
                         ids=["1-process", "3-processes-uneven-accumulating"])
def test_same_result_on_any_number_of_processes(straight, tmp_path, extra):
    # 64 over 3 ranks is uneven (22/21/21); micro-batches of 8 make each rank accumulate.
    other = _train(tmp_path / "out", *extra)
    assert other["results"]["test_accuracy"] == straight["results"]["test_accuracy"]
    assert other["results"]["steps"] == straight["results"]["steps"] == 46
    assert _max_diff(other["weights"], straight["weights"]) < ATOL_46_STEPS


@pytest.mark.parametrize("stop_at", [23, 30], ids=["epoch-end", "mid-epoch"])
def test_stop_and_resume_is_bit_identical(straight, tmp_path, stop_at):
    out = tmp_path / "out"
    stopped = _train(out, "--nproc", "2", "--max-steps", str(stop_at))
    assert stopped["results"]["steps"] == stop_at and stopped["results"]["stopped_early"]
    resumed = _train(out, "--nproc", "2", "--resume", "auto")
    assert f"at step {stop_at}" in resumed["stdout"]
    assert resumed["results"]["resumed_from_step"] == stop_at
    assert _max_diff(resumed["weights"], straight["weights"]) == 0.0
    assert resumed["results"]["final_train_loss"] == straight["results"]["final_train_loss"]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if r["type"] == "epoch"] == [1, 2]


@pytest.mark.parametrize("nproc", ["1", "3"])
def test_resume_on_another_number_of_processes(straight, tmp_path, nproc):
    out = tmp_path / "out"
    _train(out, "--nproc", "2", "--max-steps", "30")
    resumed = _train(out, "--nproc", nproc, "--resume", "auto")
    assert resumed["results"]["world_size"] == int(nproc)
    assert resumed["results"]["steps"] == 46
    assert resumed["results"]["test_accuracy"] == straight["results"]["test_accuracy"]
    assert _max_diff(resumed["weights"], straight["weights"]) < ATOL_46_STEPS


def test_resume_auto_skips_a_damaged_newest_checkpoint(straight, tmp_path):
    out = tmp_path / "out"
    _train(out, "--nproc", "2", "--max-steps", "30", "--checkpoint-every", "10", "--keep-checkpoints", "3")
    folder = out / "checkpoints"
    # every 10 steps and at the end of epoch 1 (step 23); the newest three kept
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s:08d}.pt" for s in (20, 23, 30)]
    newest = folder / "step-00000030.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn file
    (folder / ".tmp-abandoned.pt").write_bytes(b"half a write")  # a write that never finished
    resumed = _train(out, "--nproc", "2", "--resume", "auto")
    assert "at step 23" in resumed["stdout"]
    assert _max_diff(resumed["weights"], straight["weights"]) == 0.0  # 23 -> 46 replays exactly


def test_keep_checkpoints_and_checkpoint_every(tmp_path):
    out = tmp_path / "out"
    _train(out, "--nproc", "1", "--epochs", "1", "--checkpoint-every", "5", "--keep-checkpoints", "2")
    # steps 5, 10, 15, 20 and the epoch end at 23: the newest two remain
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000020.pt", "step-00000023.pt"]


def test_lr_scaling_and_warmup_recorded(tmp_path):
    out = tmp_path / "out"
    r = _train(out, "--nproc", "1", "--epochs", "1", "--batch-size", "128", "--lr-scaling", "linear",
               "--reference-batch-size", "64", "--lr", "0.05", "--warmup-epochs", "0.5", "--log-every", "1")
    assert r["results"]["peak_lr"] == pytest.approx(0.1)
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["type"] == "step"]
    # 12 steps, warmup over the first 6: from the reference LR (0.05) up to 0.1, then cosine down
    assert lrs[0] == pytest.approx(0.05 + 0.05 / 6)
    assert max(lrs) == pytest.approx(0.1)
    assert lrs.index(max(lrs)) == 5 and lrs[-1] < lrs[6]


@pytest.mark.parametrize("change", [("--model", "mlp"), ("--batch-size", "32"), ("--seed", "1"), ("--epochs", "1")],
                         ids=["model", "batch-size", "seed", "already-finished"])
def test_resume_auto_refuses_a_run_it_cannot_continue(tmp_path, change):
    # Starting afresh would overwrite the run's metrics and checkpoints: refuse, lose nothing.
    out = tmp_path / "out"
    _train(out, "--nproc", "1", "--epochs", "1")
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
    _train(out, "--nproc", "1", "--epochs", "1")
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out))  # forgot --resume auto
    assert proc.returncode == 2 and "--resume auto" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_max_steps_on_an_epoch_end_completes_that_epoch(tmp_path):
    r = _train(tmp_path / "out", "--nproc", "1", "--max-steps", "46")  # = the whole 2-epoch run
    assert r["results"]["epochs_completed"] == 2 and not r["results"]["stopped_early"]
    assert r["results"]["final_train_loss"] is not None


def test_resume_refuses_a_changed_learning_rate(tmp_path):
    out = tmp_path / "out"
    _train(out, "--nproc", "1", "--max-steps", "30")
    proc = run_cli(*COMMON, "--nproc", "1", "--out", str(out), "--resume", "auto", "--lr", "0.01")
    assert proc.returncode == 2 and "--lr" in proc.stderr  # the saved optimizer state would override it
