"""`elastic`: `ddpkit.launch` gives each worker its rank and its share of the cores, leaves the
caller's environment as it was, and runs functions from scripts without a main guard and from
programs read from stdin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import ddpkit
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


def test_launch_names_rendezvous_events_by_frame_and_hands_torch_its_own_back():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from ddpkit.launcher.elastic import method_name

    torch_own = rdzv.get_method_name
    used = ddpkit.launch(workers.rendezvous_namer, nproc=1)
    assert used[0] is True  # the forked worker saw the frame-based one, set for the launch
    assert rdzv.get_method_name is torch_own is not method_name
