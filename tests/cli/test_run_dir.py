"""Nothing corrupts a run's `--out` directory: a second run there exits 2 naming the first (and a
killed run's lock is taken over), links where a run writes are refused, a full disk while
checkpointing is one line naming the checkpoint that is intact, and `ddpkit report` reads
metrics with null (and legacy NaN) numbers."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import time

import pytest
import torch
import yaml

from ddpkit.checkpoint import shards
from tests.cli.argv_runner import run_batch
from tests.cli.helpers import ok
from tests.conftest import run_cli, start_cli
from tests.core.small_disk import small_disk

pytestmark = pytest.mark.cli

TRAIN = ("train", "--device", "cpu")


def _start(out, *extra: str) -> subprocess.Popen:
    """`ddpkit train` in the background, in a session of its own (to kill it with its workers)."""
    return start_cli(
        *TRAIN,
        "--out",
        str(out),
        *extra,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_lock(out, proc: subprocess.Popen, timeout: float = 120) -> dict:
    """What the running `proc` wrote in `out`/.lock, once it holds it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-2000:]}"
        try:
            return json.loads((out / ".lock").read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    pytest.fail("the run never locked its --out")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_second_run_in_the_same_out_exits_2_naming_the_first_which_completes_intact(tmp_path):
    out = tmp_path / "out"
    first = _start(out, "--nproc", "2", "--epochs", "8")
    try:
        holder = _wait_for_lock(out, first)
        # The first run's launcher, which holds the lock, paused while the second tries: on a
        # fast machine the first run could otherwise end before the second one looked.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = run_cli(*TRAIN, "--nproc", "2", "--epochs", "3", "--lr", "0.02", "--out", str(out))
        finally:
            os.kill(first.pid, signal.SIGCONT)
        _, first_err = first.communicate(timeout=240)
    finally:
        _stop(first)
    assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stderr.strip().splitlines() == [
        f"ddpkit train: error: --out {out}: in use by another process: pid {first.pid} on {socket.gethostname()} "
        f"(started {holder['started']}); wait for that run to end, or choose another --out"
    ]
    assert first.returncode == 0, first_err[-2000:]
    # The first run's directory is whole and its own: 8 epochs, the first run's settings.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == list(range(1, 9))
    with open(out / "metrics.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(1, 9))
    assert yaml.safe_load((out / "config.yaml").read_text())["lr"] != 0.02
    assert json.loads((out / "results.json").read_text())["epochs"] == 8
    assert not (out / ".lock").exists()  # released at exit
    ok(run_cli("report", str(out), "--out", str(tmp_path / "report.png")))


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "out"
    killed = _start(out, "--nproc", "2", "--epochs", "40")
    try:
        holder = _wait_for_lock(out, killed)
    finally:
        _stop(killed)  # SIGKILL, launcher and workers: nothing runs its exit handlers
    assert (out / ".lock").exists() and holder["pid"] == killed.pid
    proc = run_cli(*TRAIN, "--nproc", "1", "--epochs", "40", "--max-steps", "30", "--out", str(out), "--resume", "auto")
    ok(proc)
    assert f"was held by another process: pid {killed.pid} on {socket.gethostname()}" in proc.stderr
    assert "taking it over" in proc.stderr
    assert json.loads((out / "results.json").read_text())["steps"] >= 30
    assert not (out / ".lock").exists()


LINKS = [
    ("checkpoints", "outside-dir"),
    ("metrics.jsonl", "outside-file"),
    ("results.json", "dangling"),
    ("checkpoints/step-00000005.pt", "outside-file"),
]


@pytest.fixture(scope="module")
def linked(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """`ddpkit train --nproc 1 --epochs 1 --resume auto` into an --out holding one link of LINKS
    each, made ready in folders of their own and run in one helper interpreter (they are all
    refused before any worker starts; tests/cli/argv_runner.py): (name, target) -> the folder,
    where the link points, and the outcome."""
    cases = {}
    for i, (name, target) in enumerate(LINKS):
        root = tmp_path_factory.mktemp(f"link{i}")
        out, outside = root / "out", root / "outside"
        (out / "checkpoints").mkdir(parents=True)
        outside.mkdir()
        (outside / "file").write_text("not yours\n")
        if name == "checkpoints":
            (out / "checkpoints").rmdir()
        to = {"outside-dir": outside, "outside-file": outside / "file", "dangling": root / "nowhere" / "x"}[target]
        os.symlink(to, out / name)
        argv = [*TRAIN, "--nproc", "1", "--epochs", "1", "--out", str(out), "--resume", "auto"]
        cases[name, target] = {"root": root, "out": out, "to": to, "argv": argv, "cwd": str(root)}
    outcomes = run_batch([{"argv": c["argv"], "cwd": c["cwd"]} for c in cases.values()])
    return {key: {**c, **r} for (key, c), r in zip(cases.items(), outcomes)}


@pytest.mark.parametrize("name, target", LINKS)
def test_links_where_a_run_writes_are_refused_and_their_targets_untouched(linked, name, target):
    r = linked[name, target]
    out, outside, to = r["out"], r["root"] / "outside", r["to"]
    assert r["code"] == 2, r["stderr"][-2000:]
    assert r["stderr"].strip().splitlines() == [
        f"ddpkit train: error: --out {out}: {out / name} is a symbolic link (to {to}); a run writes only real files "
        f"in its directory: remove the link"
    ]
    assert sorted(os.listdir(outside)) == ["file"] and (outside / "file").read_text() == "not yours\n"
    assert not (r["root"] / "nowhere").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted({"checkpoints", name.split("/")[0]})  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("nproc,strategy", [("1", "ddp"), ("2", "ddp"), ("2", "fsdp")])
def test_a_full_disk_while_checkpointing_is_one_line_naming_the_intact_checkpoint(tmp_path, nproc, strategy):
    # Each checkpoint of the default run is about 1.2 MB: on 2 MB the first fits, the second not.
    # Under fsdp the second is written in the background (DCP; torch's zip writer said "unexpected pos").
    with small_disk(tmp_path / "disk", "2m") as disk:
        out = os.path.join(disk, "run")
        proc = run_cli(*TRAIN, "--nproc", nproc, "--strategy", strategy, "--epochs", "2", "--out", out)
        folder = os.path.join(out, "checkpoints")
        assert proc.returncode == 1, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        ranks = ("ddpkit train: rank 0 ", "ddpkit train: rank 1 ") if strategy == "fsdp" else ("ddpkit train: rank 0 ",)
        assert len(lines) == 1 and lines[0].startswith(ranks), proc.stderr[-3000:]  # no traceback
        suffix = ".pt" if strategy == "ddp" else ""  # fsdp's checkpoints are directories
        assert lines[0].endswith(
            f"failed: no space left on device writing {folder}/step-00000046{suffix}; checkpoint 23 is intact "
            f"({folder}/step-00000023{suffix})"
        )
        assert sorted(os.listdir(folder)) == [f"step-00000023{suffix}"]  # no temp file left
        if strategy == "ddp":
            assert torch.load(os.path.join(folder, "step-00000023.pt"), weights_only=True)["run"]["step"] == 23
        else:
            shards.verify(os.path.join(folder, "step-00000023"))  # whole and intact
            assert shards.read_rest(os.path.join(folder, "step-00000023"))["run"]["step"] == 23


def test_report_reads_metrics_with_null_and_with_legacy_nan(tmp_path):
    results = {"model": "cnn", "data": "digits", "world_size": 1, "global_batch_size": 64, "epochs": 1}
    for name, number in (("strict", None), ("legacy", float("nan"))):  # json.dumps writes the NaN bare
        run = tmp_path / name
        run.mkdir()
        (run / "results.json").write_text(json.dumps({**results, "test_accuracy": number, "samples_per_second": None}))
        losses = {"train_loss": number, "test_loss": number, "train_accuracy": 0.1, "test_accuracy": number}
        (run / "metrics.jsonl").write_text(json.dumps({"type": "epoch", "epoch": 1, "step": 23, **losses}) + "\n")
    proc = run_cli("report", str(tmp_path / "strict"), str(tmp_path / "legacy"), "--out", str(tmp_path / "r.png"))
    ok(proc)
    rows = proc.stdout.splitlines()[1:]
    assert len(rows) == 2 and all(" - " in row for row in rows)  # no number: a dash
    assert (tmp_path / "r.png").stat().st_size > 1000
