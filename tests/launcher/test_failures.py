"""`failures`: a failing, killed, crashed or stalled rank ends the job fast, and the report names
that rank (not a peer that lost its connection to it), with its stack where it has one. Kills
from outside at several moments of a real `ddpkit train`, and restarts, are in test_faults."""

from __future__ import annotations

import signal
import time

import pytest

import ddpkit
from ddpkit.errors import WorkerFailed
from tests import workers
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
def test_rank_that_stops_reaching_collectives_is_named_with_its_stack_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.stall_on_rank, 1, 3.0, nproc=2)
    elapsed = time.monotonic() - t0
    # rank 0's barrier gives up after 3 s; the agent then stops the stalled rank 1, which is
    # the one to blame, with the stack it was stuck in
    assert info.value.rank == 1, str(info.value)
    assert "hung" in str(info.value) and "rank 0 gave up waiting" in str(info.value)
    assert "Timed out waiting 3000ms" in str(info.value)
    assert "in stall_on_rank" in info.value.traceback and "workers.py" in info.value.traceback
    assert elapsed < 45, f"took {elapsed:.0f}s with a 3 s timeout"


@pytest.mark.distributed
@pytest.mark.parametrize("start,bad_rank", [("fork", 0), ("fork", 1), ("spawn", 1)])
def test_a_rank_killed_by_sigkill_is_blamed_not_the_peer_that_lost_its_connection(monkeypatch, start, bad_rank):
    # The peers fail with "Connection reset by peer" at about the same moment; torch's agent
    # reports whichever it notices first.
    monkeypatch.setenv("DDPKIT_START_METHOD", start)
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.die_on_rank, bad_rank, "SIGKILL", nproc=3, device="cpu")
    err = info.value
    assert err.rank == bad_rank, str(err)
    assert f"rank {bad_rank} (pid {err.pid})" in str(err) and "was killed by SIGKILL (out of memory?)" in str(err)
    assert err.exitcode == -signal.SIGKILL


@pytest.mark.distributed
def test_a_segfaulting_rank_is_blamed_with_its_stack():
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.die_on_rank, 1, "SIGSEGV", nproc=2, device="cpu")
    err = info.value
    assert err.rank == 1 and "was killed by SIGSEGV" in str(err), str(err)
    assert "in die_on_rank" in err.traceback  # faulthandler's dump of the crashing rank


@pytest.mark.distributed
def test_a_rank_that_exits_without_an_error_is_blamed_with_its_exit_code():
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.die_on_rank, 1, "exit", nproc=2, device="cpu")
    assert info.value.rank == 1 and "exited with code 3" in str(info.value), str(info.value)
