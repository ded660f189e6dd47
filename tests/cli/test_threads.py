"""The thread choice through the commands: `ddpkit env` says what a CPU `ddpkit train` would run
now and why, and `ddpkit train` started while another program keeps a core busy runs fewer
threads (results.json says how many and why). A user's OMP_NUM_THREADS wins (here through
`ddpkit env`; tests/core/test_threads.py has the Runtime's side)."""

from __future__ import annotations

import json
import time

import pytest

import ddpkit
from ddpkit.core.threads import usable_cores
from tests import workers
from tests.cli.helpers import ok
from tests.conftest import run_cli
from tests.spinner import outside_spinner

pytestmark = [pytest.mark.cli, pytest.mark.alone]  # they read the machine's load

AUTO = {"DDPKIT_THREADS": ""}  # not the suite's "share": ddpkit's own choice by load


def _env(**extra: str) -> dict:
    proc = run_cli("env", "--json", env={**AUTO, **extra})
    ok(proc)
    return json.loads(proc.stdout)["cpu"]["train_threads"]


def test_env_says_the_threads_chosen_now_and_why():
    cores = usable_cores()
    quiet = _env()
    assert 1 <= quiet["count"] <= cores and "other programs kept" in quiet["why"]
    with outside_spinner():
        time.sleep(0.3)
        busy = _env()
    assert busy["count"] == max(1, quiet["count"] - 1), (quiet, busy)  # one core fewer, on any machine
    if quiet["count"] > 1:
        assert busy["why"].startswith(f"its share of the {cores} usable cores, less the"), busy
    assert _env(OMP_NUM_THREADS="3") == {"count": 3, "why": "OMP_NUM_THREADS=3 (yours)"}
    assert _env(OMP_NUM_THREADS="4,2") == {"count": "4,2", "why": "OMP_NUM_THREADS=4,2 (yours)"}  # OpenMP's list
    text = run_cli("env", env=AUTO)
    ok(text)
    assert "torch threads per process of a CPU ddpkit train here now:" in text.stdout


def test_train_beside_a_busy_program_runs_fewer_threads_and_says_why(tmp_path):
    cores = usable_cores()
    args = ("train", "--device", "cpu", "--nproc", "1", "--epochs", "1", "--max-steps", "3")
    with outside_spinner():
        time.sleep(0.3)
        proc = run_cli(*args, "--out", str(tmp_path / "busy"), env=AUTO)
    ok(proc)
    r = json.loads((tmp_path / "busy" / "results.json").read_text())
    assert r["threads"] <= max(1, cores - 1), r["threads_why"]
    assert r["threads_why"].startswith(f"its share of the {cores} usable core")
    if cores > 1:
        assert ", less the " in r["threads_why"]


@pytest.mark.distributed
def test_launched_workers_run_the_launchers_choice_and_say_why(monkeypatch):
    monkeypatch.delenv("DDPKIT_THREADS", raising=False)
    cores = usable_cores()
    with outside_spinner():
        time.sleep(0.3)
        out = ddpkit.launch(workers.thread_facts, nproc=2, device="cpu")
    expected = max(1, min(cores // 2, (cores - 1) // 2))
    for r in out.values():
        assert r["threads"] == int(r["OMP_NUM_THREADS"]) == expected, r
        assert r["why"].startswith(f"its share of the {cores} usable cores among 2 processes"), r
        assert "other programs kept" in r["why"], r  # the load was read, not the share alone
