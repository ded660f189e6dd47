"""Failures that stop fast and lose nothing: killed workers, stalled ranks, concurrent jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ddpkit
from ddpkit.errors import WorkerFailed
from tests import workers
from tests.conftest import LAUNCH_VARS

SYNTHETIC = ("train", "--data", "synthetic", "--synthetic-size", "2048", "--epochs", "3", "--device", "cpu",
             "--checkpoint-every", "5", "--nproc", "2")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}


def _weights(out) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


def test_sigkilled_worker_is_restarted_and_the_run_ends_as_if_nothing_happened(tmp_path):
    ref = subprocess.run([sys.executable, "-m", "ddpkit", *SYNTHETIC, "--out", str(tmp_path / "ref")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", *SYNTHETIC, "--max-restarts", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    first = out / "checkpoints" / "step-00000010.pt"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # The workers are the launcher's children (forked on CPU, spawned on GPUs); spawn also
    # starts a resource tracker, which is not a worker.
    children = subprocess.run(["pgrep", "-a", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    pids = [line.split()[0] for line in children.splitlines() if "resource_tracker" not in line]
    assert len(pids) == 2, f"expected 2 workers, found {pids}"
    os.kill(int(pids[-1]), signal.SIGKILL)  # no chance to clean up, like the OOM killer
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout  # the restarted workers picked up the newest checkpoint
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_from_step"] >= 10 and results["steps"] == 96
    a, b = _weights(tmp_path / "ref"), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the uninterrupted run


def test_rank_that_stops_reaching_collectives_ends_the_job_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.stall_on_rank, 1, 3.0, nproc=2)
    elapsed = time.monotonic() - t0
    # rank 0's barrier gives up after 3 s; the agent then stops the stalled rank 1
    assert info.value.rank == 0
    assert "Timed out waiting 3000ms" in str(info.value)
    assert elapsed < 45, f"took {elapsed:.0f}s with a 3 s timeout"


def test_two_jobs_started_together_do_not_collide(tmp_path):
    args = ["train", "--epochs", "1", "--nproc", "2", "--device", "cpu"]
    procs = [subprocess.Popen([sys.executable, "-m", "ddpkit", *args, "--out", str(tmp_path / f"job{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    for i in range(2):
        assert json.loads((tmp_path / f"job{i}" / "results.json").read_text())["world_size"] == 2


def test_non_finite_loss_stops_the_run_naming_step_and_rank(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--lr", "1e6", "--epochs", "2", "--nproc", "2",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite training loss at step" in last and "on rank" in last and "--lr" in last
    assert not list((out / "checkpoints").iterdir())  # nothing trained on NaN was saved
    assert not (out / "model.pt").exists()


def _slurm_env(rank: int, ntasks: int, port: int) -> dict:
    env = _env()
    env.update({"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": str(ntasks), "SLURM_NNODES": "1", "SLURM_STEP_NODELIST": "localhost",
                "MASTER_PORT": str(port)})
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slurm_tasks_train_together(tmp_path):
    # What `srun --ntasks=2 ddpkit train ...` does: two processes with SLURM's variables set.
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "--epochs", "1", "--device", "cpu",
                               "--out", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_slurm_env(r, 2, port)) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["world_size"] == 2
    assert sum(o[0].count("done:") for o in outs) == 1  # rank 0 reports, once


def test_slurm_allocation_mismatch_is_an_immediate_error(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "train", "--nproc", "4", "--device", "cpu",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                          env=_slurm_env(0, 2, _free_port()))
    assert proc.returncode == 2 and "under srun" in proc.stderr and "--nproc" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 60  # no waiting for peers that will never come
