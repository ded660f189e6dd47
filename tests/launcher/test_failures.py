"""`failures`: a failing, killed, crashed or stalled rank ends the job fast, and the report names
that rank (not a peer that lost its connection to it), with its stack where it has one. Kills
from outside at several moments of a real `ddpkit train`, and restarts, are in test_faults."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

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
@pytest.mark.parametrize("start,bad_rank", [("fork", 0), ("fork", 1), ("spawn", 1), ("forkserver", 1)])
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
@pytest.mark.parametrize("how", ["with", "finally"])
def test_a_rank_stopped_while_its_error_unwinds_is_blamed_for_that_error_not_the_peer_that_lost_it(how):
    # Seen in CI: rank 1 raised inside `with Runtime`, whose exit closed its process group; rank 0
    # failed at once ("Connection closed by peer") and the agent stopped rank 1 before torch's
    # `record` had written its error file. Rank 0 was blamed for the peer loss. Here rank 1 lingers
    # once its group is gone, so the agent's SIGTERM always comes first: the error is noted before.
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_then_linger, 1, how, nproc=2, device="cpu")
    err = info.value
    assert err.rank == 1 and "ValueError: deliberate failure on rank 1" in str(err), str(err)
    assert "in _raise_on" in err.traceback and "deliberate failure" in err.traceback
    # stopped by the agent before its 30 s after the teardown were over, so before torch's `record`
    # ran (its status is unseen where the agent reaped it before the launcher's watch looked)
    assert err.exitcode in (-signal.SIGTERM, None) and time.monotonic() - t0 < 25


@pytest.mark.distributed
def test_a_runtime_notes_only_the_error_it_closes_on_and_a_new_runtime_forgets_it():
    assert ddpkit.launch(workers.noted_errors, nproc=1, device="cpu") == {0: [False, True, False, False]}


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


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["SIGSTOP", "SIGTSTP"])
def test_a_frozen_rank_is_blamed_as_hung_with_its_stack_at_the_timeout(capfd, how):
    # Stopped and never continued (an operator's SIGSTOP, Ctrl-Z's SIGTSTP to one process): it can
    # neither dump its stack nor die of the agent's SIGTERM. Before, it was SIGKILLed after the
    # agent's 30 s grace and reported as "killed ... (SIGKILL? out of memory?)".
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.freeze_on_rank, 1, 3.0, how, nproc=2, device="cpu")
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1, str(err)
    assert f"(pid {err.pid}) on " in str(err)
    assert f"hung: it was stopped by {how} and never continued, until rank 0 gave up waiting for it" in str(err)
    assert "Timed out waiting 3000ms" in str(err) and str(err).endswith("its stack is above")
    assert err.traceback.startswith("Stack of rank 1 when it was stopped:")
    # where it froze: continued to take the SIGTERM, another thread of it may dump the stack a
    # moment after the main thread went on from _frozen_here
    assert "in freeze_on_rank" in err.traceback, err.traceback
    # said when it happened, not only at the end
    said = [line for line in capfd.readouterr().err.splitlines() if "was stopped by" in line]
    assert len(said) == 1 and said[0].startswith(f"ddpkit: rank 1 (pid {err.pid}) was stopped by {how}: "), said
    assert elapsed < 25, f"took {elapsed:.0f}s with a 3 s timeout (the agent's SIGKILL comes 30 s after)"


@pytest.mark.distributed
def test_a_rank_stopped_as_rank_0_writes_a_checkpoint_is_blamed_at_the_jobs_timeout(tmp_path):
    # The others wait for rank 0's write with a long timeout (a slow write is no hang); rank 0,
    # done, waits for them with the job's. A rank stopped just before that wait kept rank 0 in
    # it for 30 minutes (a whole run's hang test once ran past its 90-s limit so).
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.freeze_on_rank, 1, 3.0, "SIGSTOP", str(tmp_path / "ck.pt"), nproc=2, device="cpu")
    err = info.value
    assert err.rank == 1 and "hung: it was stopped by SIGSTOP and never continued, until rank 0 gave up" in str(err)
    assert "rank(s) 1 did not come to wait for rank 0's write within 3 s" in str(err), str(err)
    assert time.monotonic() - t0 < 25


@pytest.mark.distributed
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_rank_sigtermed_from_outside_is_named_with_the_signal(capfd, restarts):
    # `kill PID` on one worker: before, the peer that lost its connection was blamed, or the
    # killed rank was said to be "stopped by the launcher", also in the line of a restart.
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.die_on_rank, 1, "SIGTERM", nproc=2, device="cpu", max_restarts=restarts)
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGTERM, str(err)
    assert str(err).endswith("was killed by SIGTERM (not from the launcher: kill, a scheduler?)"), str(err)
    assert "in die_on_rank" in err.traceback  # its stack, dumped as it got the signal
    restarted = [line for line in capfd.readouterr().err.splitlines() if "restart" in line]
    assert len(restarted) == restarts
    for line in restarted:
        assert re.fullmatch(
            r"ddpkit: restart 1 of 1: rank 1 \(pid \d+\) was killed by SIGTERM \(not from the launcher: kill, a "
            r"scheduler\?\)",
            line,
        ), line


@pytest.mark.distributed
@pytest.mark.parametrize("short", [16, 3], ids=["steps fewer", "the last batch shorter"])
def test_a_stream_that_ends_sooner_on_one_rank_names_that_rank(short):
    # An IterableDataset that reads a file of each rank's own, one of them shorter: before, the
    # rank that ran out left the others waiting in their next step, and rank 0 was blamed.
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.short_stream_on_rank, 1, short, 4.0, nproc=2, device="cpu")
    err = info.value
    assert err.rank == 1, str(err)
    said = str(err).split(" failed: ", 1)[1]
    if short == 16:  # two steps fewer: rank 0 is inside a step rank 1 never takes
        assert said.startswith(
            "rank 1's stream ended after 48 samples of epoch 0, while rank(s) 0 did not reach the end of theirs in 4 s "
            "(they read on past it, or are that far behind)"
        )
    else:  # as many steps: the ranks compare where the stream ended
        assert said.startswith("rank 1's stream ended after 61 samples of epoch 0, rank 0's after 64")
    assert said.endswith(
        "an IterableDataset must yield the same samples on every rank (ddpkit gives each rank its share of the one "
        "stream; do not split it by rank yourself)"
    )
    assert time.monotonic() - t0 < 30


@pytest.mark.distributed
def test_streams_of_the_same_length_pass_the_check_at_every_epoch_end():
    # rank 0 comes to each epoch's end 1.5 s after rank 1 (the timeout is 4 s): late, not short.
    # After the last, it is the first to leave, with the store it hosts: rank 1 has read it by then.
    assert ddpkit.launch(workers.short_stream_on_rank, 1, 0, 4.0, 1.5, nproc=2, device="cpu") == {0: 16, 1: 16}


def _attempt(root, pids: dict, stacks: dict, exits: dict, stops: float):
    """The records of attempt 0 of a launch in `root`, as its workers and the launcher's watch
    leave them: each rank's pid file (written 10 s before `stops`), the stacks their handlers
    dumped {rank: when}, the exits the watch saw {rank: (status, when)}, and when the agent
    began to stop the workers."""
    from ddpkit.launcher import records

    folder = root / "attempt-0"
    folder.mkdir()
    for rank, pid in pids.items():
        (folder / f"rank-{rank}.pid").write_text(str(pid))
        os.utime(folder / f"rank-{rank}.pid", (stops - 10, stops - 10))  # started well before
    for rank, when in stacks.items():
        (folder / f"rank-{rank}.stack").write_text(f"Stack of rank {rank}:\n  File 'x.py', line 1 in f\n")
        os.utime(folder / f"rank-{rank}.stack", (when, when))
    for rank, (status, when) in exits.items():
        (folder / f"rank-{rank}.exit").write_text(json.dumps({"status": status, "seen": True}))
        os.utime(folder / f"rank-{rank}.exit", (when, when))  # the watch's record, made when it looked
    (root / records.STOPS).mkdir()
    (root / records.STOPS / "stop-1").touch()
    os.utime(root / records.STOPS / "stop-1", (stops, stops))
    return folder


@pytest.mark.unit
def test_a_sigterm_from_outside_is_told_by_when_each_rank_got_its_signal_not_when_the_parent_looked(tmp_path):
    # Under load the parent's SIGCHLD watch looked once for both deaths and stamped rank 0 (the
    # launcher's SIGTERM) before rank 1 (killed from outside), in the order of their records:
    # rank 0 was blamed. The stacks their handlers dumped say when each got its signal.
    from ddpkit.launcher import failures

    t = time.time()
    stamped = {rank: (-signal.SIGTERM, t + rank * 0.001) for rank in (0, 1)}  # one look, rank 0 first
    _attempt(tmp_path, {0: 1000, 1: 1001}, {0: t - 1.0, 1: t - 2.0}, stamped, stops=t - 0.5)
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert cause.rank == 1 and cause.outside, cause


@pytest.mark.unit
def test_a_worker_the_agent_reaped_first_still_has_its_exit_recorded(tmp_path):
    # Under load torch's agent may reap a worker before the launcher's SIGCHLD watch looks:
    # then no `.exit` record said how it ended, and a SIGTERM from outside could not be told.
    from types import SimpleNamespace

    from ddpkit.launcher import failures, records

    t = time.time()
    seen = {0: (0, t)}  # the watch saw rank 0 end
    folder = _attempt(tmp_path, {0: 4000, 1: 4001}, {0: t - 2, 1: t - 1}, seen, stops=t + 5)
    records.note_failures(str(tmp_path), {1: SimpleNamespace(pid=4001, exitcode=-signal.SIGTERM)})
    assert json.loads((folder / "rank-1.exit").read_text())["status"] == -signal.SIGTERM
    records.note_failures(str(tmp_path), {0: SimpleNamespace(pid=4000, exitcode=-signal.SIGKILL)})
    assert json.loads((folder / "rank-0.exit").read_text())["status"] == 0  # the watch's own is kept
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert cause.rank == 1 and cause.outside, cause


@pytest.mark.unit
def test_a_sigkilled_rank_the_agent_reaped_first_is_blamed_not_the_peer_it_sigtermed(tmp_path):
    # Under load torch's agent reaped SIGKILLed rank 1 before the launcher's SIGCHLD watch looked,
    # and SIGTERMed rank 0 before its stops were recorded. Rank 1's end was stamped when the
    # failure was noted (after rank 0's): rank 0 was blamed, "killed by SIGTERM (not from the
    # launcher)". When rank 1 ended is not known, so it may have ended first.
    from types import SimpleNamespace

    from ddpkit.launcher import failures, records

    t = time.time()
    _attempt(tmp_path, {0: 5000, 1: 5001}, {0: t - 1.0}, {0: (-signal.SIGTERM, t - 0.9)}, stops=t - 0.5)
    records.note_failures(str(tmp_path), {1: SimpleNamespace(pid=5001, exitcode=-signal.SIGKILL)})
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert cause.rank == 1 and cause.status == -signal.SIGKILL and not cause.outside, cause
    what, _ = failures.describe(cause, failures.endings(str(tmp_path), 0, {}, 0))
    assert what == "was killed by SIGKILL (out of memory?)"


# A worker armed as the launcher's are, and waiting; with "crashes", it takes SIGTERM as
# faulthandler sometimes does when another thread got the signal: a dump without a header, then
# SIGSEGV (its handler replaces faulthandler's for SIGTERM, and does what that one did, then crashes).
_ARMED = """
import ctypes, faulthandler, signal, sys, time
from ddpkit.launcher import records
records.arm()
if sys.argv[1] == "crashes":
    def stopped(signum, frame):
        faulthandler.dump_traceback(file=records._stack_file, all_threads=True)
        ctypes.string_at(0)
    signal.signal(signal.SIGTERM, stopped)
print(flush=True)
time.sleep(60)
"""


@pytest.mark.distributed  # worker processes armed as the launcher's are, without gloo
@pytest.mark.parametrize("sigtermed", ["dies", "crashes"])
def test_a_peer_sigtermed_just_after_a_kill_is_not_taken_for_the_cause(tmp_path, sigtermed):
    # A file's time trails `time.time()` by up to a tick of the kernel's coarse clock (8 ms here).
    # The watch stamped a SIGKILLed rank's end with `time.time()`, and the agent's SIGTERM to its
    # peer a moment later left a stack whose file time could be earlier: the peer was blamed,
    # "killed by SIGTERM (not from the launcher)" (seen in CI under pp 2). Later, in CI under pp 2
    # again, the peer crashed while faulthandler dumped its stack for that SIGTERM, and was blamed,
    # "killed by SIGSEGV": its stack's time was the kill's, to the tick. Real workers here: two
    # processes armed as a launch's workers are, the watch's real look, then the agent's order.
    # (The first blame holds without telling a crash mid-dump from a crash, where the stack's time
    # comes after the kill's record; the tie at the end does not.)
    from ddpkit.launcher import failures, records

    (tmp_path / "attempt-0").mkdir()
    (tmp_path / records.STOPS).mkdir()  # the agent's stops come later: none recorded yet
    workers = []
    for rank in (0, 1):
        env = {**clean_env(), records.LAUNCH_DIR: str(tmp_path), "RANK": str(rank)}
        argv = [sys.executable, "-c", _ARMED, sigtermed if rank == 0 else "dies"]
        workers.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE))
    try:
        for w in workers:
            w.stdout.readline()  # armed
        time.sleep(0.3)  # the stack files were opened a while ago, as a worker's are
        watch = records.ExitWatch(str(tmp_path))
        workers[1].send_signal(signal.SIGKILL)  # killed from outside
        while os.waitid(os.P_PID, workers[1].pid, os.WEXITED | os.WNOWAIT) is None:
            pass
        watch._on_child()  # the watch's look, on SIGCHLD
        workers[0].send_signal(signal.SIGTERM)  # the agent stops the rest: a stack dumped, then the end
        os.waitid(os.P_PID, workers[0].pid, os.WEXITED | os.WNOWAIT)
        watch._on_child()
    finally:
        for w in workers:
            w.kill()
            w.wait()
    ends = records.read_attempt(str(tmp_path), 0)
    took = {"dies": -signal.SIGTERM, "crashes": -signal.SIGSEGV}[sigtermed]
    assert (ends[0].status, ends[1].status) == (took, -signal.SIGKILL) and ends[0].stack
    assert ends[0].stack.startswith("Current thread") or ends[0].stack.startswith("Thread")  # a SIGTERM's dump
    assert ("Fatal Python error: Segmentation fault" in ends[0].stack) == (sigtermed == "crashes")
    # One clock for both: the times of the files the watch and the dying rank wrote (the race
    # itself, a look that lands within a coarse tick of the next signal, is rare to catch).
    folder = tmp_path / "attempt-0"
    assert ends[1].ended == os.path.getmtime(folder / "rank-1.exit")
    assert ends[0].ended == min(os.path.getmtime(folder / "rank-0.exit"), os.path.getmtime(folder / "rank-0.stack"))
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert (cause.rank, cause.status, cause.outside) == (1, -signal.SIGKILL, False), cause
    # Within one tick, as CI had it: the kill and the dumped stack share a time.
    tie = os.path.getmtime(folder / "rank-1.exit")
    os.utime(folder / "rank-0.stack", (tie, tie))
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert (cause.rank, cause.status, cause.outside) == (1, -signal.SIGKILL, False), cause


@pytest.mark.unit
def test_the_error_a_rank_noted_as_its_runtime_closed_counts_only_for_a_rank_that_did_not_end_well(
    tmp_path, monkeypatch
):
    from ddpkit.launcher import failures, records

    t = time.time()
    folder = _attempt(tmp_path, {0: 7000, 1: 7001}, {}, {0: (1, t + 0.1), 1: (-signal.SIGTERM, t + 0.3)}, stops=t + 0.2)
    monkeypatch.setenv(records.LAUNCH_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    records.note_raised()  # nothing unwinds
    for interrupt in (KeyboardInterrupt(), SystemExit(1)):  # not a rank's error, as for torch's `record`
        try:
            raise interrupt
        except BaseException:
            records.note_raised()
    assert not (folder / "rank-1.raised").exists()
    # rank 1 raised, then was stopped by the agent after rank 0 failed with a code: rank 1 began first
    try:
        raise ValueError("its own")
    except ValueError:
        records.note_raised()
    os.utime(folder / "rank-1.raised", (t, t))
    cause = failures.blame(str(tmp_path), 0, {}, 0)
    assert (cause.rank, cause.kind, cause.status, cause.when) == (1, "raised", -signal.SIGTERM, t), cause
    assert failures.describe(cause, {})[0] == "failed: ValueError: its own"
    assert not list(folder.glob("*.part"))
    (folder / "rank-1.exit").unlink()  # its status unknown (the agent reaped it first) ...
    (folder / "rank-1.done").touch()  # ... but it caught the error and returned: the record is void
    assert failures.blame(str(tmp_path), 0, {}, 0).rank == 0


@pytest.mark.unit
def test_a_scripts_error_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    # torch writes the error file in place; the agent's SIGTERM (a peer had failed first) once
    # stopped that write half-way, and the agent crashed parsing the empty file (JSONDecodeError,
    # `ddpkit run` under --max-restarts). Written beside it and renamed: never seen half-written.
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from ddpkit.launcher import script

    final = tmp_path / "error.json"
    monkeypatch.setenv(script.ERROR_FILE, str(final))
    own = ErrorHandler.record_exception
    seen_while_writing = []

    def record_exception(self, err):
        seen_while_writing.append(final.exists())
        own(self, err)
        seen_while_writing.append(final.exists())

    monkeypatch.setattr(ErrorHandler, "record_exception", record_exception)
    try:
        raise ValueError("boom")
    except ValueError as err:
        script._record(err)
    assert seen_while_writing == [False, False]  # the write went elsewhere
    data = json.loads(final.read_text())
    assert data["message"]["message"] == "ValueError: boom" and "boom" in data["message"]["extraInfo"]["py_callstack"]
    assert list(tmp_path.iterdir()) == [final] and os.environ[script.ERROR_FILE] == str(final)
