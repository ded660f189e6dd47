"""Processes started by hand with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the tutorials'
recipe, or srun's tasks) meet in ddpkit's own wait: it says within seconds what it waits for,
Ctrl-C and SIGTERM end it at once with one line, and a job that never gathers, or a port that
another program holds, is one line and exit 2. Before, torch's rendezvous waited in C++ for the
whole --timeout (600 s) with every signal held."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.cli.helpers import free_port
from tests.conftest import clean_env

pytestmark = pytest.mark.cli


def _env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    env = clean_env()
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    return env


def _train(rank: int, port: int, out, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddpkit", "train", "--device", "cpu", "--out", str(out), *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(rank, port))


def _first_line(proc: subprocess.Popen, deadline_s: float = 60) -> str:
    """The first line on `proc`'s stderr, which must come before the deadline."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    assert sel.select(timeout=deadline_s), f"nothing said within {deadline_s} s"
    return proc.stderr.readline().rstrip("\n")


def test_two_processes_started_by_hand_meet_when_the_second_comes_late(tmp_path):
    # The tutorials' recipe: the same command on each "node", rank 1 started two seconds later.
    port = free_port()
    first = _train(0, port, tmp_path / "out", "--epochs", "1")
    time.sleep(2)
    second = _train(1, port, tmp_path / "out", "--epochs", "1")
    outs = [p.communicate(timeout=240) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["world_size"] == 2
    assert "waited" not in outs[0][1]  # 2 s is within the quiet part of the wait


def test_a_wait_for_peers_says_what_it_waits_for_and_a_signal_ends_it(tmp_path):
    # Rank 0 waits for a rank 1 that never comes; a rank 1 waits for a rank 0 that never comes.
    started = time.monotonic()
    host = _train(0, free_port(), tmp_path / "a")
    guest = _train(1, free_port(), tmp_path / "b")
    said = {p: _first_line(p) for p in (host, guest)}
    assert time.monotonic() - started < 30  # within seconds, not at the timeout
    assert said[host].startswith("ddpkit: rank 0 of 2 has waited 5 s for 1 more of the job's 2 processes to join at")
    assert said[guest].startswith("ddpkit: rank 1 of 2 has waited 5 s for rank 0's store at 127.0.0.1:")
    assert said[host].endswith("(Ctrl-C stops)") and said[guest].endswith("(Ctrl-C stops)")
    host.send_signal(signal.SIGINT)
    guest.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    host_err, guest_err = host.communicate(timeout=30)[1], guest.communicate(timeout=30)[1]
    assert time.monotonic() - stopped < 10  # at once: the wait is not held in C++ until the timeout
    assert (host.returncode, guest.returncode) == (130, 143)
    assert host_err.strip().splitlines() == ["ddpkit train: interrupted; no checkpoint was written yet"]
    assert guest_err.strip().splitlines() == ["ddpkit train: interrupted; no checkpoint was written yet"]
    assert not (tmp_path / "a" / "results.json").exists()


def test_a_job_that_never_gathers_is_one_line_and_exit_2_at_the_timeout(tmp_path):
    procs = {rank: _train(rank, free_port(), tmp_path / str(rank), "--timeout", "2") for rank in (0, 1)}
    errs = {rank: p.communicate(timeout=60)[1] for rank, p in procs.items()}
    for rank, p in procs.items():
        assert p.returncode == 2, errs[rank][-2000:]
        lines = errs[rank].strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"ddpkit train: error: rank {rank} of 2: waited 2 s for ")
        assert "did not gather. Start every process of it, or unset those variables to run alone" in lines[0]
        assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in lines[0]


def test_a_master_port_another_program_holds_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _train(0, port, tmp_path / "out")
        err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        f"ddpkit train: error: MASTER_PORT={port} is in use on 127.0.0.1: rank 0 cannot host the job's store "
        "there. Choose a free port (ddpkit run picks one itself)"
    ]
    assert not [f for f in (tmp_path / "out").rglob("*") if f.is_file()]  # nothing written


def test_a_node_waiting_for_the_others_says_so_and_a_signal_ends_it(tmp_path):
    # `ddpkit run --nnodes 2` on one machine only: the agent's rendezvous waits for the other
    # node, in Python (interruptible), and now says what for
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    argv = ["--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd = [sys.executable, "-m", "ddpkit", "run", *argv, "--node-rank", "0", str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    said = _first_line(proc)
    assert said.startswith("ddpkit: this node has waited 5 s for the job's 2 nodes to gather at 127.0.0.1:"), said
    assert said.endswith("(--nnodes 2, --master-addr, --master-port; Ctrl-C stops)"), said
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["ddpkit run: interrupted"] and "hi" not in out


def test_a_rank_whose_master_port_reaches_another_program_says_so_and_gives_up_at_the_timeout(tmp_path):
    # It accepts the connection but never answers torch's handshake: that wait was in C++, for
    # ever (a signal did nothing); now it is ddpkit's wait like any other
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(16)
        port = holder.getsockname()[1]
        started = time.monotonic()
        proc = _train(1, port, tmp_path / "out", "--timeout", "3")
        err = proc.communicate(timeout=60)[1]
    assert time.monotonic() - started < 30
    assert proc.returncode == 2, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("ddpkit")]
    assert lines == [
        f"ddpkit train: error: rank 1 of 2: waited 3 s for an answer from 127.0.0.1:{port}, which accepts connections "
        "but may not be rank 0's store; the job its environment describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
        f"meeting at 127.0.0.1:{port}) did not gather. Start every process of it, or unset those variables to run alone"
    ], err[-2000:]
