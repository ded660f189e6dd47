"""Start-up: CPU workers are forked (and behave as spawned ones would), and `ddpkit bench
startup` runs the same job under ddpkit and under torchrun."""

from __future__ import annotations

import json
import os
import threading
import signal
import sys
import time

import pytest
import torch

import ddpkit
from ddpkit.launcher.workers import choose_start_method
from ddpkit.errors import WorkerFailed
from tests import workers
from tests.conftest import run_comparison

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def worker_facts() -> dict:
    import numpy as np

    a = torch.randn(512, 512)
    (a @ a).sum()  # a parallel region on the worker's threads: hangs if the parent's pool was inherited
    return {"forked": hasattr(sys, "_ddpkit_test_parent_marker"),  # set in the parent at run time
            "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "threads": torch.get_num_threads(), "numpy": float(np.random.rand())}


def die_once_on_rank1() -> int:
    """Rank 1 of the first attempt dies without a word (like the OOM killer's victim)."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt


@pytest.fixture
def marked_parent(monkeypatch):
    monkeypatch.setattr(sys, "_ddpkit_test_parent_marker", True, raising=False)


@linux_only
@pytest.mark.timeout(120)
def test_cpu_workers_are_forked_yet_look_spawned(monkeypatch, marked_parent):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(1024, 1024)
        (a @ a).sum()  # this process now keeps a 2-thread OpenMP pool, which a fork must not inherit
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the workers run parallel regions of 2 threads too
        assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
        out = ddpkit.launch(worker_facts, nproc=2, device="cpu")
    finally:
        torch.set_num_threads(threads)
    for facts in out.values():
        assert facts["forked"] and facts["threads"] == 2
        # the agent's signal handlers are not inherited: a worker it stops dies at once
        assert facts["sigterm_default"] and facts["sigint_default"]
    assert out[0]["numpy"] != out[1]["numpy"]  # each rank's own NumPy stream, as when spawned


@linux_only
@pytest.mark.parametrize("fn,args,nproc,rank,needle", [
    (workers.fail_on_rank, (1,), 3, 1, "ValueError: deliberate failure on rank 1"),
    (workers.stall_on_rank, (1, 3.0), 2, 0, "Timed out waiting 3000ms"),  # the stalled rank is stopped, not blamed
])
def test_forked_workers_name_the_failing_rank(fn, args, nproc, rank, needle):
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(fn, *args, nproc=nproc, device="cpu")
    assert info.value.rank == rank and needle in str(info.value)
    assert time.monotonic() - t0 < 25  # the agent's 30 s wait before SIGKILL never comes into play


@linux_only
def test_forked_workers_are_restarted_after_a_sigkill():
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    assert ddpkit.launch(die_once_on_rank1, nproc=2, device="cpu", max_restarts=1) == {0: 1, 1: 1}


def test_spawn_on_request(monkeypatch, marked_parent):
    monkeypatch.setenv("DDPKIT_START_METHOD", "spawn")
    assert choose_start_method("cpu") == "spawn"
    out = ddpkit.launch(worker_facts, nproc=2, device="cpu")
    assert not any(facts["forked"] for facts in out.values())
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=2, device="cpu")
    assert info.value.rank == 1


def test_cuda_workers_are_spawned():
    assert choose_start_method("cuda") == "spawn"


def test_bench_startup_runs_the_same_job_under_ddpkit_and_torchrun(tmp_path):
    path, png = tmp_path / "x.json", tmp_path / "x.png"
    t0 = time.monotonic()
    proc = run_comparison("startup", "--quick", "--repeats", "1", "--contenders", "ddpkit,torchrun",
                          "--json", str(path), "--plot", str(png), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(path.read_text())["result"]
    assert set(r["contenders"]) == {"ddpkit", "torchrun"}
    assert set(r["skipped"]) == {"accelerate", "fabric"}  # not selected
    for c in r["contenders"].values():
        assert c["wall_seconds"]["n"] == 1 and c["wall_seconds"]["median"] > 0
        assert c["test_accuracy"] > 0.9  # both trained the digits, not merely started
    ddp = r["contenders"]["ddpkit"]
    assert 0 < ddp["results_wall_seconds"]["median"] < ddp["wall_seconds"]["median"]
    assert set(r["speedup_vs"]) == {"torchrun"} and isinstance(r["ddpkit_fastest"], bool)
    assert r["job"]["epochs"] == 10 and r["job"]["processes"] == 2
    assert png.stat().st_size > 0
    assert "ddpkit fastest" in proc.stdout
    assert time.monotonic() - t0 < 120


def test_bench_startup_bad_contender():
    proc = run_comparison("startup", "--contenders", "ddpkit,nosuch")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--contenders" in lines[0] and "nosuch" in lines[0]


def test_bench_startup_names_what_is_missing(monkeypatch):
    import importlib.util

    from benchmarks import startup

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    assert "lightning is not installed" in startup._missing("fabric") and "ddpkit[bench]" in startup._missing("fabric")
    assert startup._missing("torchrun") is None
