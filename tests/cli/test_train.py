"""`ddpkit train` end to end, run as real subprocesses (`python -m ddpkit train`): the files and
keys in --out, one report from rank 0, resume after a stop and after a crash, the default run's
accuracy, a config file under the flags, the strategies, and --help.

Multi-process training is expensive on a 2-core machine, so one `ddpkit train --nproc 2
--epochs 2` run (the `run1` fixture, tests/cli/conftest.py) is shared by every test that only
reads its outputs (and by the bad-input cases that point at its files); the resume test works
on its own copy of that directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
import yaml

import ddpkit
from ddpkit import data as ddpkit_data
from ddpkit import models as ddpkit_models
from ddpkit import strategy as ddpkit_strategy
from tests.cli.helpers import DIGITS_TEST, DIGITS_TRAIN, ok
from tests.conftest import run_cli

pytestmark = pytest.mark.cli


RESULT_KEYS = (
    "threads",
    "threads_why",
    "test_accuracy",
    "test_samples",
    "train_samples",
    "world_size",
    "global_batch_size",
    "epochs",
    "steps",
    "final_train_loss",
    "samples_per_second",
    "wall_seconds",
    "device",
    "strategy",
    "precision",
    "seed",
    "ddpkit_version",
    "torch_version",
)


def _results(out) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line must be JSON


def test_run1_exits_zero(run1):
    out, proc = run1
    ok(proc)
    assert "Traceback" not in proc.stderr


def test_run1_results_json(run1):
    out, proc = run1
    ok(proc)
    r = _results(out)
    missing = [k for k in RESULT_KEYS if k not in r]
    assert not missing, f"results.json lacks {missing}"
    assert r["world_size"] == 2
    assert r["test_samples"] == DIGITS_TEST
    assert r["train_samples"] == DIGITS_TRAIN
    assert r["strategy"] == "ddp"
    assert r["global_batch_size"] == 64
    assert r["epochs"] == 2
    assert r["steps"] == 2 * math.ceil(DIGITS_TRAIN / 64) == 46
    assert r["device"] == "cpu"
    assert r["precision"] == "fp32"
    assert r["seed"] == 0
    assert r["ddpkit_version"] == ddpkit.__version__
    assert r["torch_version"] == torch.__version__
    assert 0.0 <= r["test_accuracy"] <= 1.0
    assert r["test_accuracy"] > 0.5  # two epochs on digits learn far more than chance (0.1)
    assert math.isfinite(r["final_train_loss"]) and r["final_train_loss"] > 0
    assert r["samples_per_second"] > 0
    assert r["wall_seconds"] > 0


def test_run1_timeline_runs_from_the_process_start_to_the_workers_exit(run1):
    from ddpkit.observe.timeline import MOMENTS

    out, proc = run1
    ok(proc)
    r = _results(out)
    timeline = r["timeline"]
    assert list(timeline) == list(MOMENTS)  # every moment of a 2-process run, in order
    # rank 0 left curves.png to the command's helper; the command waited for it after the
    # workers ended, then wrote results.json (without the hand-over)
    assert timeline["workers_exited"] <= timeline["curves_drawn"]
    assert not [k for k in r if k.startswith("_")]
    seconds = list(timeline.values())
    assert seconds[0] > 0 and seconds == sorted(seconds)
    # results.json's wall_seconds starts after the imports and ends before the outputs
    assert timeline["outputs_written"] - timeline["imports_done"] > r["wall_seconds"] > 0
    # the first step's end comes from the step timer, not a clock read: still in its place
    assert timeline["model_ready"] < timeline["first_step_done"] < timeline["training_done"]


def test_run1_metrics_jsonl(run1):
    out, proc = run1
    ok(proc)
    records = _metrics(out)
    epochs = [r for r in records if r.get("type") == "epoch"]
    steps = [r for r in records if r.get("type") == "step"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["step"] for r in epochs] == [23, 46]
    assert all(r["test_samples"] == DIGITS_TEST for r in epochs)
    assert steps, "no step records"
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    assert all(r["step"] % 10 == 0 for r in steps)  # --log-every defaults to 10
    assert all(math.isfinite(r["loss"]) for r in steps)
    # the last epoch record is what results.json reports
    assert epochs[-1]["test_accuracy"] == pytest.approx(_results(out)["test_accuracy"], abs=1e-12)


def test_run1_model_pt_is_a_plain_state_dict_of_the_bare_model(run1):
    out, proc = run1
    ok(proc)
    state = torch.load(out / "model.pt", weights_only=True, map_location="cpu")
    assert isinstance(state, dict) and state
    prefixed = [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert not prefixed, f"wrapper prefixes in model.pt: {prefixed}"
    model = ddpkit_models.build("cnn", (1, 8, 8), 10)
    model.load_state_dict(state, strict=True)
    model.eval()
    test = ddpkit_data.digits().test
    x, y = test.tensors
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).double().mean().item()
    assert len(y) == DIGITS_TEST
    assert abs(acc - _results(out)["test_accuracy"]) <= 1e-6


def test_run1_curves_png(run1, tmp_path):
    out, proc = run1
    ok(proc)
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 1000
    # Drawn by the command's helper process (ddpkit.observe.plotter): the same bytes as drawn here
    # from metrics.jsonl's epoch records.
    from ddpkit.observe.plots import plot_curves

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plot_curves([r for r in records if r["type"] == "epoch"], str(tmp_path / "here.png"), "cnn on digits")
    assert (tmp_path / "here.png").read_bytes() == png


def test_run1_config_yaml(run1):
    out, proc = run1
    ok(proc)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] == 64
    assert cfg["epochs"] == 2
    assert cfg["device"] == "cpu"
    assert str(cfg["nproc"]) == "2"


def test_run1_checkpoints(run1):
    out, proc = run1
    ok(proc)
    names = sorted(os.listdir(out / "checkpoints"))
    assert "step-00000046.pt" in names
    assert not [n for n in names if n.startswith(".tmp")], f"temp files left behind: {names}"
    ckpt = torch.load(out / "checkpoints" / "step-00000046.pt", weights_only=True, map_location="cpu")
    assert ckpt["run"]["epoch"] == 2
    assert ckpt["run"]["step"] == 46


def test_run1_only_rank0_prints(run1):
    out, proc = run1
    ok(proc)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("done:") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("epoch   1/2") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("epoch   2/2") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("ddpkit train:") for line in lines) == 1, proc.stdout


@pytest.mark.slow
def test_resume_auto_continues_to_epoch_3(run1, tmp_path):
    src, proc1 = run1
    ok(proc1)
    out = tmp_path / "resumed"
    shutil.copytree(src, out)  # run1's own files stay as they were for the other tests
    proc = run_cli(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--resume",
        "auto",
        "--out",
        str(out),
        "--device",
        "cpu",
        cwd=str(tmp_path),
    )
    ok(proc)
    assert "resumed from" in proc.stdout
    r = _results(out)
    assert r["resumed_from_step"] == 46
    assert r["epochs"] == 3
    assert r["steps"] == 69
    assert r["test_samples"] == DIGITS_TEST
    records = _metrics(out)
    epochs = [rec["epoch"] for rec in records if rec.get("type") == "epoch"]
    assert epochs == [1, 2, 3]  # appended, not rewritten
    assert (out / "checkpoints" / "step-00000069.pt").is_file()
    # epochs 1 and 2 were not run again
    assert "epoch   1/3" not in proc.stdout and "epoch   2/3" not in proc.stdout
    assert sum(line.startswith("epoch   3/3") for line in proc.stdout.splitlines()) == 1


@pytest.mark.slow
def test_resume_after_a_crash_ends_where_the_uninterrupted_run_ends(run1, tmp_path):
    # run1 (2 epochs), and the same run "crashed" during its last epoch: its last checkpoint and
    # final outputs gone, and step records of the lost epoch left in metrics.jsonl. Resuming must
    # restore model, optimizer, scheduler, loader position and RNG so the end is bit-identical.
    full, proc1 = run1
    ok(proc1)
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)  # run1's own files stay as they were for the other tests
    for name in ("checkpoints/step-00000046.pt", "model.pt", "results.json"):
        (crashed / name).unlink()
    assert (crashed / "checkpoints" / "step-00000023.pt").is_file()  # the end of epoch 1: resumed from
    kept = [
        line
        for line in (crashed / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["step"] <= 23 or json.loads(line)["type"] == "step"
    ]
    (crashed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    proc = run_cli(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--device",
        "cpu",
        "--resume",
        "auto",
        "--out",
        str(crashed),
        cwd=str(tmp_path),
    )
    ok(proc)
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(crashed / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _results(crashed)["test_accuracy"] == _results(full)["test_accuracy"]
    assert _results(crashed)["resumed_from_step"] == 23
    steps = [(r["type"], r["step"]) for r in _metrics(crashed)]
    assert steps == [(r["type"], r["step"]) for r in _metrics(full)]  # lost epoch's records not doubled


def test_default_run_reaches_97_percent(default_run):
    out, proc = default_run  # `ddpkit train --nproc 1 --device cpu --out DIR` (tests/conftest.py)
    ok(proc)
    r = _results(out)
    assert r["epochs"] == 10
    assert r["world_size"] == 1
    assert r["test_samples"] == DIGITS_TEST
    assert r["test_accuracy"] >= 0.97, r


@pytest.fixture(scope="module")
def config_run(tmp_path_factory):
    """One 1-process run for two tests: a config file under the command-line flags, and
    --strategy single."""
    root = tmp_path_factory.mktemp("config_run")
    config = root / "cfg.yaml"
    config.write_text("epochs: 1\nbatch-size: 32\nmodel: mlp\n")
    out = root / "out"
    args = ("--config", str(config), "--batch-size", "16", "--strategy", "single", "--nproc", "1", "--device", "cpu")
    proc = run_cli("train", *args, "--out", str(out), cwd=str(root))
    ok(proc)
    return out


def test_config_file_and_command_line_override(config_run):
    out = config_run
    r = _results(out)
    assert r["epochs"] == 1  # from the file
    assert r["model"] == "mlp"  # from the file
    assert r["global_batch_size"] == 16  # the flag beats the file's 32
    assert r["steps"] == math.ceil(DIGITS_TRAIN / 16)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["batch_size"] == 16
    assert cfg["epochs"] == 1
    assert cfg["model"] == "mlp"
    state = torch.load(out / "model.pt", weights_only=True)
    ddpkit_models.build("mlp", (1, 8, 8), 10).load_state_dict(state, strict=True)


def test_strategy_single(config_run):
    r = _results(config_run)  # --strategy single --nproc 1, one epoch at global batch 16
    assert r["strategy"] == "single"
    assert r["world_size"] == 1
    assert r["steps"] == math.ceil(DIGITS_TRAIN / 16)


@pytest.fixture(scope="module")
def toy_dp_run(tmp_path_factory):
    """`--strategy dp` on CPU (no --nproc), on the toy data with a global batch larger than its
    training set: one run for the two tests of these."""
    out = tmp_path_factory.mktemp("toy_dp") / "toy"
    proc = run_cli(
        "train", "--data", "toy", "--model", "mlp", "--batch-size", "8", "--epochs", "2", "--strategy", "dp",
        "--device", "cpu", "--out", str(out),
    )  # fmt: skip
    ok(proc)
    return out, proc


def test_strategy_dp_on_cpu_runs_as_single(toy_dp_run):
    # strategy.resolve: 'dp' needs a CUDA device and at least two GPUs; otherwise it is 'single'.
    assert ddpkit_strategy.resolve_name("dp", 1, torch.device("cpu")) == "single"
    out, proc = toy_dp_run
    r = _results(out)
    assert r["strategy"] == "single"
    assert r["world_size"] == 1
    assert "DataParallel" not in proc.stderr  # no nn.DataParallel wrapper (and so no warning) on CPU


def test_train_help(cli, tmp_path):
    proc = cli("train", "--help", cwd=str(tmp_path))
    ok(proc)
    assert "--batch-size" in proc.stdout
    assert "GLOBAL" in proc.stdout
    assert not os.listdir(tmp_path), "--help wrote files"


def test_a_global_batch_larger_than_the_training_set_is_trained_with_a_warning(toy_dp_run):
    # Full-batch steps may be meant (a recipe's batch on a small smoke-test set): said, not refused.
    out, proc = toy_dp_run
    assert "warning: --batch-size 8 is larger than the 5 training samples of --data toy" in proc.stderr
    assert json.loads((out / "results.json").read_text())["steps"] == 2  # one step per epoch: the whole set


@pytest.mark.cli
def test_without_a_terminal_progress_lines_come_at_the_interval_asked(tmp_path):
    # stderr is a pipe here, as in a log file or a batch job: no bar, and before, nothing at all
    # between the first line and the end (minutes on a gpt run)
    # (lines come at checks, at least 0.5 s apart within an epoch: 6 epochs of 90 steps give several)
    flags = ("--epochs", "6", "--batch-size", "16")
    proc = run_cli("train", *flags, "--progress-every", "0.2", "--out", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit train: epoch ")]
    assert lines, proc.stderr
    for line in lines:
        assert re.fullmatch(
            r"ddpkit train: epoch [1-6]/6, step \d+/90 of it \(\d+%\), loss \d+\.\d{4}, [\d,]+ samples/s", line
        ), line
    quiet = run_cli("train", *flags, "--progress-every", "0", "--out", str(tmp_path / "b"))
    assert quiet.returncode == 0 and "ddpkit train: epoch " not in quiet.stderr, quiet.stderr
