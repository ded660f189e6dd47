"""What the training loop reports: the train accuracy under `--on-nonfinite skip` is over the same
samples as its loss; a restart after the last checkpoint prints no epoch beyond the last and
reports the throughput of the attempt that trained; the progress bar's throughput reads as a
unit; and the README shows the summary `ddpkit train` prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, clean_env, run_cli

pytestmark = pytest.mark.cli

DIGITS_TRAIN, BATCH = 1438, 64


def records(out, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def test_train_accuracy_with_skipped_steps_is_over_the_samples_counted(tmp_path):
    # --lr 1e6 makes most losses non-finite; one process, so a step is skipped exactly when its
    # one batch's loss was not finite, and the samples counted are those of the other steps.
    out = tmp_path / "out"
    args = ("--epochs", "1", "--nproc", "1", "--lr", "1e6", "--on-nonfinite", "skip")
    proc = run_cli("train", "--device", "cpu", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = {r["step"] for r in records(out, "skip")}
    steps = -(-DIGITS_TRAIN // BATCH)
    sizes = {s: min(BATCH, DIGITS_TRAIN - (s - 1) * BATCH) for s in range(1, steps + 1)}
    counted = sum(n for s, n in sizes.items() if s not in skipped)
    assert skipped and counted  # some steps skipped, some trained on
    accuracy = records(out, "epoch")[0]["train_accuracy"]
    correct = accuracy * counted  # was 1.1406 with the skipped steps' correct answers counted
    assert 0 <= accuracy <= 1 and abs(correct - round(correct)) < 1e-6


KILL_AFTER_LAST_CHECKPOINT = """
import os, signal, sys

from ddpkit.cli import main
from ddpkit.trainer.loop import Loop

measure = Loop.performance


def killed_once(self, rate):
    # Rank 1 of the first attempt dies after the last checkpoint, as the out-of-memory killer
    # might: the restarted workers find nothing left to train.
    if self.rt.rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return measure(self, rate)


Loop.performance = killed_once  # the workers are forked from this process: they run it too
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_restart_after_the_last_checkpoint_reports_the_run_that_trained(tmp_path):
    program = tmp_path / "kill_after_last_checkpoint.py"
    program.write_text(KILL_AFTER_LAST_CHECKPOINT)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(program), "train", "--epochs", "2", "--nproc", "2", "--device", "cpu"]
        + ["--max-restarts", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [line for line in proc.stdout.splitlines() if "; resumed from" in line]
    assert len(resumed) == 1 and "at step 46" in resumed[0] and "training had finished" in resumed[0]
    assert "epoch 3" not in proc.stdout and "epoch   3/2" not in proc.stdout  # it printed "epoch 3" of 2
    r = json.loads((out / "results.json").read_text())
    assert r["resumed_from_step"] == r["steps"] == 46 and r["epochs_completed"] == 2
    basis = r["samples_per_second_basis"]
    assert basis["measured_by"] == "the attempt before the restart" and basis["samples"] == 2 * DIGITS_TRAIN
    assert r["samples_per_second"] == pytest.approx(basis["samples"] / basis["train_seconds"])  # it was 0


@pytest.fixture(scope="module")
def on_a_terminal(one_epoch_run):
    """What the session's one-epoch run on a pseudo-terminal (tests/conftest.py) printed: its
    stdout and what its terminal showed."""
    _, stdout, terminal = one_epoch_run
    return stdout, terminal


def test_the_progress_bar_shows_samples_per_second_as_a_unit(on_a_terminal):
    _, terminal = on_a_terminal
    assert re.search(r"loss \d+\.\d{4}, [\d,]+ samples/s", terminal), terminal[-2000:]
    assert "samples_s" not in terminal


def summary_labels(text: str) -> list[str]:
    """The row labels of the table printed after the `done:` line."""
    lines = text.split("\ndone: ", 1)[1].splitlines()[1:]
    return [m.group(1) for line in lines if (m := re.match(r"  (\S.*?)\s{2,}\S", line))]


def test_the_readme_shows_the_summary_train_prints(on_a_terminal):
    stdout, _ = on_a_terminal
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("<!-- transcript: train -->", 1)[1].split("```", 2)[1]
    assert summary_labels(block) == summary_labels(stdout) != []
    assert "second line" not in readme


@pytest.mark.slow
def test_a_compiled_run_on_two_processes_trains_as_the_eager_one(jobs_started_together):
    # Compiled around DDP, nothing was compiled; compiled inside it, torch 2.13's inductor
    # zeroed the convolutions' gradients at 32 samples per rank unless told not to reorder.
    # Both: `--nproc 2 --epochs 1`, the second with --compile (tests/conftest.py).
    weights = {}
    for name, (out, proc) in jobs_started_together.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "torch.compile produced no graph" not in proc.stderr
        weights[name] = torch.load(out / "model.pt", weights_only=True)
    assert json.loads((jobs_started_together["compiled"][0] / "results.json").read_text())["compile_seconds"] > 0
    diff = max((weights["compiled"][k] - weights["eager"][k]).abs().max().item() for k in weights["eager"])
    assert diff < 1e-4  # inductor's kernels round differently; the bug made it 1e-1
