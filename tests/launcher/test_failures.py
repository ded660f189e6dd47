"""`failures`: failures that stop fast and lose nothing: a failing or stalled rank ends the job
naming the rank, and a SIGKILLed worker is restarted and the run ends as if nothing happened."""

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
from tests.conftest import clean_env
from tests.launcher.helpers import run_python


@pytest.mark.distributed
def test_failing_worker_stops_the_run_and_names_its_rank():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=3)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "deliberate failure on rank 1" in str(info.value)
    assert "ValueError" in str(info.value) and "deliberate failure" in info.value.traceback
    # The other ranks were blocked in a barrier; the agent must stop them, not wait 10 minutes.
    assert elapsed < 60, f"took {elapsed:.0f}s"


@pytest.mark.distributed
def test_program_whose_worker_raises_exits_nonzero_quickly():
    t0 = time.monotonic()
    proc = run_python("""
        import sys, ddpkit

        def main():
            with ddpkit.Runtime(device="cpu") as rt:
                if rt.rank == 1:
                    raise RuntimeError("rank one broke")
                rt.barrier()

        try:
            ddpkit.launch(main, nproc=2)
        except ddpkit.WorkerFailed as err:
            print(err, file=sys.stderr)
            sys.exit(1)
    """)
    assert proc.returncode == 1
    assert "rank 1" in proc.stderr and "RuntimeError: rank one broke" in proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.distributed
def test_rank_that_stops_reaching_collectives_ends_the_job_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.stall_on_rank, 1, 3.0, nproc=2)
    elapsed = time.monotonic() - t0
    # rank 0's barrier gives up after 3 s; the agent then stops the stalled rank 1
    assert info.value.rank == 0
    assert "Timed out waiting 3000ms" in str(info.value)
    assert elapsed < 45, f"took {elapsed:.0f}s with a 3 s timeout"


SYNTHETIC = (
    "train",
    "--data",
    "synthetic",
    "--synthetic-size",
    "2048",
    "--epochs",
    "3",
    "--device",
    "cpu",
    "--checkpoint-every",
    "5",
    "--nproc",
    "2",
)


def _weights(out) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.cli
@pytest.mark.slow
def test_sigkilled_worker_is_restarted_and_the_run_ends_as_if_nothing_happened(tmp_path):
    ref = subprocess.run(
        [sys.executable, "-m", "ddpkit", *SYNTHETIC, "--out", str(tmp_path / "ref")],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *SYNTHETIC, "--max-restarts", "1", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
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
