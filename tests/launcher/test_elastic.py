"""`elastic`: `ddpkit.launch` gives each worker its rank and its share of the cores, leaves the
caller's environment as it was, and runs functions from scripts without a main guard and from
programs read from stdin."""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import ddpkit
from ddpkit.launcher import elastic
from tests import workers
from tests.conftest import SRC
from tests.launcher.helpers import run_python

pytestmark = pytest.mark.distributed


def test_launcher_sets_rank_env_and_thread_share():
    out = ddpkit.launch(workers.env_facts, nproc=2)
    assert [out[r]["RANK"] for r in (0, 1)] == ["0", "1"]
    assert {out[r]["WORLD_SIZE"] for r in (0, 1)} == {"2"}
    assert {out[r]["MASTER_ADDR"] for r in (0, 1)} == {"127.0.0.1"}  # loopback only on one machine
    assert {out[r]["OMP_NUM_THREADS"] for r in (0, 1)} == {str(max(1, len(os.sched_getaffinity(0)) // 2))}


def test_the_workers_port_is_held_before_they_start_and_new_for_each_attempt(tmp_path):
    # The agent holds the port of the workers' store from before they start: nothing else can
    # take it before rank 0 binds it (a port picked, let go, and bound later by rank 0 could be
    # taken by another launch on the machine: "address already in use"). Rank 0 looks before it
    # binds the port itself. Each attempt gets a store of its own: attempt 1's process group
    # does not read attempt 0's peer addresses (pytorch/pytorch#135712).
    out = ddpkit.launch(workers.store_per_attempt, str(tmp_path), nproc=2, max_restarts=1)
    notes = {p.stem: ast.literal_eval(p.read_text()) for p in tmp_path.glob("rank*-attempt*.txt")}
    assert set(notes) == {"rank0-attempt0", "rank1-attempt0", "rank0-attempt1", "rank1-attempt1"}
    assert notes["rank0-attempt0"]["held"] and notes["rank0-attempt1"]["held"]
    assert all(facts["sum"] == 2.0 for facts in notes.values())
    first, second = notes["rank0-attempt0"]["port"], notes["rank0-attempt1"]["port"]
    assert notes["rank1-attempt0"]["port"] == first and notes["rank1-attempt1"]["port"] == second != first
    assert out == {0: notes["rank0-attempt1"], 1: notes["rank1-attempt1"]}


def test_an_interrupted_launch_lets_the_workers_port_go(tmp_path):
    # After a signal torch leaves its rendezvous open (for the other nodes) and skips its
    # shutdown: the port held for the workers' store must still be let go as the launch ends,
    # not when the handler holding it is collected (here the caller keeps the error, whose
    # traceback holds torch's frames and so the handler, and collection is switched off).
    notes = str(tmp_path)
    proc = run_python(f"""
        import gc, os, signal, socket, time
        import ddpkit
        from ddpkit.errors import Interrupted

        def work(notes):
            if os.environ["RANK"] == "0":
                with open(os.path.join(notes, "port"), "w") as f:
                    f.write(os.environ["MASTER_PORT"])
                os.kill(os.getppid(), signal.SIGINT)  # Ctrl-C, to the launching process
            time.sleep(60)  # until the agent stops it

        gc.disable()
        try:
            ddpkit.launch(work, {notes!r}, nproc=2, device="cpu")
        except Interrupted as err:
            kept = err
            print("interrupted")
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", int(open(os.path.join({notes!r}, "port")).read())))
            print("free")
        except OSError:
            print("held")
    """)
    assert proc.stdout.split() == ["interrupted", "free"], proc.stdout + proc.stderr[-2000:]


def test_a_signal_whose_handler_raised_in_a_fork_hook_still_stops_the_launch():
    # Python runs a signal's handler at the main thread's next instruction: for one noted just
    # before the agent forks a worker, that is inside a fork hook, where the agent's exception
    # is printed and dropped ("Exception ignored in"), and the launch ran on to its end. Here a
    # hook that runs before the launcher's own sends the signal during rank 1's fork.
    # (tests/launcher/test_workers.py checks the other signals and KeyboardInterrupt, in-process)
    proc = run_python("""
        import os, signal, time
        import ddpkit
        from ddpkit.errors import Interrupted
        from ddpkit.launcher.workers import preloaded

        def work():
            time.sleep(30)
            return "ran to the end"

        with preloaded(["json"]):  # the launcher's fork hooks, registered before the one below
            pass
        forks = []

        def signal_during_a_fork():
            forks.append(1)
            if len(forks) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent's handler raises here

        os.register_at_fork(before=signal_during_a_fork)
        try:
            print(ddpkit.launch(work, nproc=2, device="cpu"))
        except Interrupted as err:
            print("interrupted", err.signum == signal.SIGTERM)
    """)
    assert proc.stdout.split() == ["interrupted", "True"], proc.stdout + proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr


def test_a_launch_holds_its_folder_and_removes_those_of_killed_launches(tmp_path, monkeypatch):
    # A launch killed by SIGKILL (or the OOM killer) cannot remove its temporary folder; the
    # next launch on the machine does, and never one whose launch still runs.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the workers are forked: theirs too)
    killed = tmp_path / f"{elastic.LAUNCH_PREFIX}killed"
    (killed / "attempt-0").mkdir(parents=True)
    (killed / elastic.HELD).touch()
    os.utime(killed / elastic.HELD, (time.time() - 600,) * 2)
    out = ddpkit.launch(workers.launch_folder_held, nproc=2)
    assert out == {0: True, 1: True}  # each worker found its launch's folder held
    assert not killed.exists() and not list(tmp_path.glob(f"{elastic.LAUNCH_PREFIX}*"))  # and its own removed


def test_launch_leaves_the_callers_environment_as_it_was():
    import logging

    assert "OMP_NUM_THREADS" not in os.environ
    ddpkit.launch(workers.env_facts, nproc=2)
    assert "OMP_NUM_THREADS" not in os.environ
    # torch sets its agent's log level when the module is first imported (by the launch above);
    # ddpkit silences it only during a launch and must hand it back afterwards.
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.setLevel(logging.INFO)
    level = agent_log.level
    ddpkit.launch(workers.env_facts, nproc=2)
    assert "OMP_NUM_THREADS" not in os.environ  # a later launch with another nproc starts clean
    assert agent_log.level == level


def test_launch_from_a_script_without_main_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent("""
        import os, ddpkit
        print("top level", flush=True)

        def work():
            return int(os.environ["RANK"])

        print("results", ddpkit.launch(work, nproc=2))
    """)
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("top level") == 1  # the workers did not re-run the script
    assert "results {0: 0, 1: 1}" in proc.stdout


def test_launch_function_defined_in_stdin_program():
    # `python -` has no main file for spawn to re-import: the classic "DDP can't run here" case.
    proc = run_python("""
        import ddpkit, torch
        OFFSET = 100

        def main(scale):
            with ddpkit.Runtime(device="cpu") as rt:
                total = rt.all_reduce(torch.tensor([float(rt.rank + OFFSET)]))
                rt.print("total", total.item())
                return rt.rank * scale

        print("results", ddpkit.launch(main, 10, nproc=2))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "results {0: 0, 1: 10}" in proc.stdout
    assert proc.stdout.count("total 201.0") == 1  # rank 0 only


def test_launch_names_rendezvous_events_as_torch_does_and_hands_torch_its_own_back(monkeypatch):
    # The names torch's rendezvous gives its events in a real launch: the same with ddpkit's
    # frame-based lookup as with torch's own inspect.stack(), and torch's own is back after.
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from ddpkit.launcher import elastic

    torch_own = rdzv.get_method_name
    seen: list[tuple[str, bool]] = []

    def record(*args, **kwargs):  # torch's recorder, which drops the event anyway
        seen.append((kwargs["name"], rdzv.get_method_name is elastic.method_name))

    monkeypatch.setattr(rdzv, "construct_and_record_rdzv_event", record)
    ddpkit.launch(workers.env_facts, nproc=1)
    ours, seen[:] = list(seen), []
    assert rdzv.get_method_name is torch_own
    monkeypatch.setattr(elastic, "_rendezvous_events_named_by_frame", contextlib.nullcontext)
    ddpkit.launch(workers.env_facts, nproc=1)
    assert all(by_frame for _, by_frame in ours) and not any(by_frame for _, by_frame in seen)
    names = sorted(name for name, _ in ours)
    assert names == sorted(name for name, _ in seen)
    assert "DynamicRendezvousHandler.next_rendezvous" in names and not any(n.endswith("._record") for n in names)
