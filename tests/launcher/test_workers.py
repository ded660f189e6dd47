"""`workers`: CPU workers are forked (and behave as spawned ones would: their own signal handlers,
threads and random streams), name the failing rank and restart after a SIGKILL; spawn on
request, and always on CUDA."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

import ddpkit
from ddpkit.errors import WorkerFailed
from ddpkit.launcher.workers import choose_start_method
from tests import workers

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def worker_facts() -> dict:
    import numpy as np

    a = torch.randn(512, 512)
    (a @ a).sum()  # a parallel region on the worker's threads: hangs if the parent's pool was inherited
    return {
        "forked": hasattr(sys, "_ddpkit_test_parent_marker"),  # set in the parent at run time
        "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "threads": torch.get_num_threads(),
        "numpy": float(np.random.rand()),
    }


def die_once_on_rank1() -> int:
    """Rank 1 of the first attempt dies without a word (like the OOM killer's victim)."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt


@pytest.fixture
def marked_parent(monkeypatch):
    monkeypatch.setattr(sys, "_ddpkit_test_parent_marker", True, raising=False)


@pytest.mark.distributed
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


@pytest.mark.distributed
@linux_only
@pytest.mark.parametrize(
    "fn,args,nproc,rank,needle",
    [
        (workers.fail_on_rank, (1,), 3, 1, "ValueError: deliberate failure on rank 1"),
        (workers.stall_on_rank, (1, 3.0), 2, 1, "hung"),  # the stalled rank is stopped, and blamed
    ],
)
def test_forked_workers_name_the_failing_rank(fn, args, nproc, rank, needle):
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(fn, *args, nproc=nproc, device="cpu")
    assert info.value.rank == rank and needle in str(info.value)
    assert time.monotonic() - t0 < 25  # the agent's 30 s wait before SIGKILL never comes into play


@pytest.mark.distributed
@linux_only
def test_forked_workers_are_restarted_after_a_sigkill():
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    assert ddpkit.launch(die_once_on_rank1, nproc=2, device="cpu", max_restarts=1) == {0: 1, 1: 1}


@pytest.mark.distributed
def test_spawn_on_request(monkeypatch, marked_parent):
    monkeypatch.setenv("DDPKIT_START_METHOD", "spawn")
    assert choose_start_method("cpu") == "spawn"
    out = ddpkit.launch(worker_facts, nproc=2, device="cpu")
    assert not any(facts["forked"] for facts in out.values())
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=2, device="cpu")
    assert info.value.rank == 1


@pytest.mark.unit
def test_cuda_workers_are_spawned():
    assert choose_start_method("cuda") == "spawn"
