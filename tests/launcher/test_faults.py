"""Fault injection from outside, as the out-of-memory killer or an operator would: SIGKILL a worker
of `ddpkit train` at several moments of a run, or signal the launcher itself.

After a SIGKILL the job restarts and ends bit-identical to an uninterrupted run, and the restart
line names the killed process (one run is killed at every moment in turn, restarting after each:
the startup and training of one run, not of one per moment). A Ctrl-C or SIGTERM to the launcher
ends the job at once with one line and exit code 130 or 143, no traceback and no worker left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import start_cli

pytestmark = [pytest.mark.cli, pytest.mark.slow]

# The session's `two_process_run` (tests/conftest.py) with a checkpoint every 4 steps: 23 steps an
# epoch on digits, 46 in all
RUN = ("train", "--epochs", "2", "--device", "cpu", "--checkpoint-every", "4", "--nproc", "2")


def _start(
    out: Path, *extra: str, run: tuple[str, ...] = RUN, stdout: Any = None, stderr: Any = None
) -> subprocess.Popen:
    # forked from the tests' command server (tests/cli_server.py): the test after the start
    return start_cli(
        *run,
        *extra,
        "--out",
        str(out),
        stdout=stdout or subprocess.PIPE,
        stderr=stderr or subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what a terminal's Ctrl-C reaches
    )


def _workers(proc: subprocess.Popen) -> list[int]:
    """The launcher's worker processes (forked on CPU), oldest first."""
    return [pid for _, pid in sorted((start, pid) for pid, (start, helper) in _children(proc).items() if not helper)]


def _curves_helper(proc: subprocess.Popen) -> list[int]:
    """The launcher's other child: the process that draws curves.png (ddpkit.observe.plotter)."""
    return [pid for pid, (_, helper) in _children(proc).items() if helper]


def _children(proc: subprocess.Popen) -> dict[int, tuple[int, bool]]:
    """{pid: (when it started, whether it is the curves helper)} of the launcher's children
    alive now. A child listed may be gone a moment later (a killed worker, reaped): its /proc
    entry then reads as missing or empty, and it is left out."""
    listed = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    children = {}
    for pid in map(int, listed):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            # clock ticks after boot when it started: field 22 of /proc/PID/stat (after the
            # name, which is in parentheses and may hold spaces)
            start = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
        except (OSError, IndexError, ValueError):  # gone (ESRCH, ENOENT), or a zombie's empty entry
            continue
        children[pid] = (start, b"ddpkit.observe.plotter" in cmdline)
    return children


def _wait_for(
    proc: subprocess.Popen, ready: Callable[[], bool], what: str, timeout: float = 120, poll: float = 0.01
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never saw {what}: {(proc.communicate()[1] or '')[-2000:]}")
        time.sleep(poll)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(two_process_run) -> dict[str, torch.Tensor]:
    """The weights of RUN uninterrupted: the session's run of its flags but --checkpoint-every."""
    out, proc = two_process_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    return _weights(out)


def _checkpoint(step: int) -> Callable[[Path], bool]:
    return lambda out: (out / "checkpoints" / f"step-{step:08d}.pt").exists()


def _epoch_logged(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.exists() and '"test_accuracy"' in metrics.read_text()


# (moment, the condition that marks it, extra delay, which worker: 0 the first started, -1 the last)
MOMENTS = [
    # (the workers start after the launching process imported torch's compiler for them: they
    # are building their process group, data and model for about 0.05 s, then train)
    ("while starting up", lambda out: True, 0.03, -1),
    ("right after the first checkpoint", _checkpoint(4), 0.0, 0),
    ("in the middle of an epoch", _checkpoint(8), 0.15, -1),
    ("at the end of the first epoch", _epoch_logged, 0.0, 0),
    ("after the last checkpoint", _checkpoint(46), 0.0, -1),
]


def _new_pair(proc: subprocess.Popen, earlier: set[int]) -> bool:
    """True once the launcher runs two workers, none of them one of `earlier` (a new attempt's)."""
    try:
        workers = _workers(proc)
    except FileNotFoundError:  # a worker of the attempt that just ended vanished while listed
        return False
    return len(workers) == 2 and not earlier.intersection(workers)


@pytest.fixture(scope="module")
def killed_at_every_moment(tmp_path_factory):
    """One run (a restart allowed per kill) whose workers are SIGKILLed at each of the MOMENTS in
    turn: each kill lands at its moment of the run's life (before any checkpoint, just after the
    first, mid-epoch, at the first epoch's end, after the last checkpoint), the later ones in an
    attempt that restarted after the kill before. Returns the out directory, the victims' pids in
    order, and the launcher's exit code, stdout and stderr."""
    out = tmp_path_factory.mktemp("killed") / "run"
    logs = out.parent / "stdout.txt", out.parent / "stderr.txt"
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        proc = _start(out, "--max-restarts", str(len(MOMENTS)), stdout=stdout, stderr=stderr)
    said = lambda note: note in logs[0].read_text() + logs[1].read_text()  # noqa: E731
    victims: list[int] = []
    earlier: set[int] = set()
    for k, (moment, ready, delay, which) in enumerate(MOMENTS):
        _wait_for(proc, lambda: _new_pair(proc, earlier), "two workers")
        # A restarted attempt says why before it trains: a kill before that (its moment's file
        # may be an earlier attempt's, when a loaded machine let that one run on) would end the
        # attempt unannounced.
        _wait_for(proc, lambda k=k: k == 0 or said(f"restart {k} of {len(MOMENTS)}"), f"restart {k}'s note")
        # The attempt's workers, listed before its moment, so that the kill follows the moment at
        # once: after the last checkpoint only the outputs are left, a fraction of a second, and
        # listing them then (pgrep, /proc) on a loaded machine once let the worker end first.
        workers = _workers(proc)
        _wait_for(proc, lambda ready=ready: ready(out), moment, poll=0.002)
        time.sleep(delay)
        earlier.update(workers)
        victims.append(workers[which])
        os.kill(victims[-1], signal.SIGKILL)
    proc.wait(timeout=300)
    return out, victims, proc.returncode, logs[0].read_text(), logs[1].read_text()


@pytest.mark.parametrize("kill", range(len(MOMENTS)), ids=[m[0] for m in MOMENTS])
def test_a_sigkilled_worker_is_named_and_the_run_ends_as_if_nothing_happened(killed_at_every_moment, reference, kill):
    out, victims, code, stdout, stderr = killed_at_every_moment
    assert code == 0, stderr[-3000:]
    note = f"restart {kill + 1} of {len(MOMENTS)}"
    restart = [line for line in (stdout + stderr).splitlines() if note in line]
    assert len(restart) == 1, stdout + stderr
    assert re.search(rf"{note}: rank [01] \(pid {victims[kill]}\) was killed by SIGKILL", restart[0]), restart[0]
    assert "; resumed from " in restart[0] or "; no checkpoint was written yet" in restart[0], restart[0]
    ref, got = reference, _weights(out)
    assert all(torch.equal(ref[k], got[k]) for k in ref), (
        f"weights differ after the kills (this one {MOMENTS[kill][0]})"
    )


@pytest.mark.parametrize("sig,said", [(signal.SIGTERM, "was killed by SIGTERM (not from the launcher: kill, a scheduler?)"),
                                      (signal.SIGSTOP, "hung: it was stopped by SIGSTOP and never continued")])  # fmt: skip
def test_a_signal_to_one_worker_of_a_train_names_that_worker_and_the_signal(tmp_path, sig, said):
    # `kill PID` or `kill -STOP PID` on one worker of `ddpkit train`: that rank and the signal are
    # named, not the peer that lost its connection to it, nor "killed by SIGKILL (out of memory?)"
    out = tmp_path / "run"
    proc = _start(out, "--timeout", "3")
    _wait_for(proc, lambda: _checkpoint(4)(out), "a checkpoint")
    victim = _workers(proc)[-1]
    os.kill(victim, sig)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert re.match(rf"ddpkit train: rank [01] \(pid {victim}\) on \S+ {re.escape(said)}", last), last


@pytest.mark.parametrize(
    "sig,code,to_group",
    [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)],
    ids=["SIGINT to the launcher", "SIGTERM to the launcher", "Ctrl-C in a terminal (its process group)"],
)
def test_ctrl_c_or_sigterm_stops_the_job_with_one_line_and_no_worker_left(tmp_path, sig, code, to_group):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for(proc, lambda: _checkpoint(4)(out), "a checkpoint")
    workers = _workers(proc) + _curves_helper(proc)
    assert len(workers) == 3  # and the helper that would draw curves.png: left behind neither
    (os.killpg if to_group else os.kill)(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit train: interrupted; last checkpoint"), stderr
    newest = sorted((out / "checkpoints").glob("step-*.pt"))[-1]
    assert f"last checkpoint {newest} (continue with --resume auto)" in lines[0]
    for pid in workers:  # gone, not left running (a zombie would have been reaped by init)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("after", [0.0, 0.6], ids=["in the rendezvous", "while the fork waits for the import"])
def test_a_signal_while_the_workers_are_started_stops_the_job(tmp_path, sig, code, after):
    # The launcher imports torch's compiler for its workers while its agent starts them (a
    # thread; the fork waits for it): a signal in that time stops the job as at any other
    # time, and no worker is left waiting for an import that will never finish.
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    proc = start_cli(
        *RUN,
        "--out",
        str(out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"TMPDIR": str(tmp)},  # where the launch makes its folder, as it begins
        start_new_session=True,
        fresh=True,  # a fresh interpreter's start: the compiler's import is the moment under test
    )
    launching = lambda: any(tmp.glob("ddpkit-launch-*")) and not _workers(proc)  # noqa: E731
    _wait_for(proc, launching, "the launch, before any worker")
    time.sleep(after)  # the rendezvous sleeps 0-0.3 s; the import takes 0.7-0.9 s
    os.kill(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    # Timed from outside, the signal can come late on a loaded machine (the workers started and
    # wrote their first checkpoint): the line must then name it, as at any later moment.
    saved = sorted((out / "checkpoints").glob("step-*.pt")) if (out / "checkpoints").is_dir() else []
    said = f"last checkpoint {saved[-1]} (continue with --resume auto)" if saved else "no checkpoint was written yet"
    assert stderr.strip().splitlines() == [f"ddpkit train: interrupted; {said}"], stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_a_one_process_run_without_out_names_its_default_folder(tmp_path, sig, code):
    args = [*RUN[:-1], "1"]  # --nproc 1: the run is in this very process
    proc = start_cli(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_for(proc, lambda: any(tmp_path.glob("runs/*/checkpoints/step-*.pt")), "a checkpoint in runs/")
    proc.send_signal(sig)  # SIGHUP: the terminal closed; before, it ended the run without a word
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert re.fullmatch(
        r"ddpkit train: interrupted; last checkpoint runs/\S+/checkpoints/step-\d+\.pt \(.*\)", lines[0]
    )


def test_after_a_sigkilled_launcher_the_next_run_takes_its_folder_over_and_resumes(tmp_path, reference):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for(proc, lambda: _checkpoint(8)(out), "a checkpoint")
    workers = _workers(proc) + _curves_helper(proc)  # the helper ends once no one holds its pipe
    assert len(workers) == 3
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: no agent is left to stop the workers
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers), "workers outlived their launcher"
    again = _start(out, "--resume", "auto")  # takes over the dead run's lock, continues its checkpoints
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    got = _weights(out)
    assert all(torch.equal(reference[k], got[k]) for k in reference)


def test_script_workers_die_with_a_sigkilled_launcher(tmp_path):
    # torch's agent sets no parent-death signal for script workers (it does for functions)
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    proc = start_cli("run", "--nproc", "2", str(script), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(proc, lambda: len(_workers(proc)) == 2, "two workers")
    time.sleep(1.0)  # past the wrapper's start, into the script
    workers = _workers(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    for pid in alive:  # leave nothing behind, even when failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, "script workers outlived their launcher"


# RUN under fsdp: the session's `fsdp_two_process_run` (tests/conftest.py) with a checkpoint every 4 steps
FSDP_RUN = (*RUN, "--strategy", "fsdp")


def test_a_sigkilled_fsdp_worker_resumes_from_its_sharded_checkpoint_and_ends_the_same(fsdp_two_process_run, tmp_path):
    reference, done = fsdp_two_process_run  # the same run, uninterrupted and without --checkpoint-every
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    proc = _start(out, "--max-restarts", "1", run=FSDP_RUN)
    _wait_for(proc, lambda: (out / "checkpoints" / "step-00000008" / ".metadata").exists(), "a sharded checkpoint")
    time.sleep(0.15)  # into the next steps, with the write of 8 done or under way in the background
    victim = _workers(proc)[-1]
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    restart = [line for line in (stdout + stderr).splitlines() if "restart 1 of 1" in line]
    assert len(restart) == 1 and f"(pid {victim}) was killed by SIGKILL" in restart[0], stdout + stderr
    assert re.search(r"resumed from \S+/checkpoints/step-000000\d\d at step", restart[0]), restart[0]
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the interrupted writes were pruned or finished
    ref, got = _weights(reference), _weights(out)
    assert all(torch.equal(ref[k], got[k]) for k in ref), "weights differ after a kill under fsdp"


def _said(stderr: str) -> str:
    """What a failed run's stderr says: its end, and before it a fatal error's dump from its
    start (its innermost frames come first; the end alone showed only the outer ones)."""
    at = stderr.find("Fatal Python error")
    return (stderr[at : at + 4000] + "\n...\n" if at >= 0 else "") + stderr[-3000:]


def _corpus(folder: Path) -> Path:
    """Four documents of uneven length: a few hundred sequences of 32 bytes."""
    folder.mkdir()
    for i, n in enumerate((2400, 300, 5000, 90)):
        (folder / f"doc{i}.txt").write_bytes(bytes((97 + (j * j + i) % 26) for j in range(n)))
    return folder


@pytest.mark.parametrize(
    "mesh,nproc,runs",
    [("dp=2,tp=2", 4, "tp"), ("replicate=2,dp=2", 4, "hsdp"), ("pp=2", 2, "pp")],
    ids=["fsdp+tp 2x2", "hsdp 2x2", "pp 2"],
)
def test_ddpkit_train_on_a_mesh_trains_and_a_sigkilled_worker_resumes_bit_identical(tmp_path, mesh, nproc, runs):
    """`ddpkit train --model gpt --nproc 4 --mesh dp=2,tp=2` (fsdp+tp), `--mesh replicate=2,dp=2`
    (hsdp) and `--nproc 2 --mesh pp=2` (two pipeline stages) train and write their outputs; a
    worker killed after the first sharded checkpoint restarts the job, whose restart line names
    the killed rank's mesh coordinates, and it ends bit-identical."""
    from ddpkit import models

    mesh_run = (
        "train", "--model", "gpt", "--data", "text", "--text-path", str(_corpus(tmp_path / "corpus")),
        "--gpt-width", "16", "--gpt-depth", "2", "--gpt-heads", "2", "--seq-len", "32", "--gpt-dropout", "0.1",
        "--batch-size", "8", "--epochs", "1", "--max-steps", "12", "--device", "cpu", "--nproc", str(nproc),
        "--mesh", mesh, "--checkpoint-every", "4",
    )  # fmt: skip
    reference = tmp_path / "reference"
    done = _start(reference, run=mesh_run)
    stdout, stderr = done.communicate(timeout=300)
    assert done.returncode == 0, _said(stderr)
    results = json.loads((reference / "results.json").read_text())
    assert (results["strategy"], results["mesh"], results["world_size"]) == (runs, mesh, nproc)
    assert results["steps"] == 12 and (reference / "curves.png").exists()
    bare = models.build("gpt", (32,), 256, width=16, depth=2, heads=2)
    bare.load_state_dict(_weights(reference), strict=True)  # model.pt: one plain state_dict, whole tensors
    out = tmp_path / "run"
    proc = _start(out, "--max-restarts", "1", run=mesh_run)
    _wait_for(proc, lambda: (out / "checkpoints" / "step-00000004" / ".metadata").exists(), "a sharded checkpoint")
    time.sleep(0.15)
    victim = _workers(proc)[-1]
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, _said(stderr)
    restart = [line for line in (stdout + stderr).splitlines() if "restart 1 of 1" in line]
    said = re.search(
        rf"rank (\d) \(((?:replicate|dp|pp)=\d(?:,(?:dp|tp)=\d)?), pid {victim}\) was killed by SIGKILL",
        restart[0] if restart else "",
    )
    assert len(restart) == 1 and said, stdout + stderr
    rank, where = int(said.group(1)), said.group(2)  # the killed rank, and its place on the mesh
    expected = {
        "tp": f"dp={rank // 2},tp={rank % 2}",
        "hsdp": f"replicate={rank // 2},dp={rank % 2}",
        "pp": f"pp={rank}",
    }
    assert where == expected[runs]
    ref, got = _weights(reference), _weights(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), "weights differ after a kill"
