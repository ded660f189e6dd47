"""ddpkit.core.threads: each CPU process's torch threads, its share of the usable cores less those
other programs keep busy. A real busy process is the load: one outside this process tree
counts, a child of this process (as ddpkit's helper and workers are) does not."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from ddpkit.core import threads
from tests.spinner import SPIN, outside_spinner

pytestmark = [pytest.mark.unit, pytest.mark.alone]  # they read the machine's load


def _busy_over(seconds: float) -> float:
    start = threads.read()
    time.sleep(seconds)
    busy, window = threads.others_busy(since=start)
    assert window >= seconds
    return busy


def test_a_program_outside_counts_as_busy_and_a_child_does_not():
    # Against the machine's own background, measured first: the test holds on a busy CI too.
    baseline = _busy_over(0.6)
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.2)  # past its start-up
        assert _busy_over(0.6) - baseline < 0.4  # our own child spins: not another program's load
    finally:
        child.kill()
        child.wait()
    with outside_spinner():
        time.sleep(0.2)
        assert _busy_over(0.6) - baseline > 0.6  # about one core


def test_a_child_that_ended_during_the_window_is_not_another_programs_load():
    start = threads.read()
    subprocess.run([sys.executable, "-c", SPIN.replace("60", "0.6")], check=True)  # spins, ends, is reaped
    busy, _ = threads.others_busy(since=start)
    assert busy < 0.4


def test_the_choice_gives_fewer_threads_when_other_programs_keep_cores_busy(monkeypatch):
    monkeypatch.delenv(threads.MODE, raising=False)
    cores = threads.usable_cores()
    with outside_spinner():
        time.sleep(0.2)
        monkeypatch.setattr(threads, "_start", threads.read())
        time.sleep(0.6)
        count, why = threads.choose(1)
    assert count == max(1, cores - 1) and f"its share of the {cores} usable core" in why
    if cores > 1:
        assert "less the" in why and "other programs kept busy" in why
    monkeypatch.setenv(threads.MODE, "share")
    assert threads.choose(1) == (
        cores,
        f"its share of the {cores} usable core{'s' if cores > 1 else ''}, whatever the load (DDPKIT_THREADS=share)",
    )
    assert threads.choose(10 * cores)[0] == 1


def test_a_short_window_is_waited_out_and_an_old_one_read_afresh(monkeypatch):
    # Right after the import (a script's Runtime) the reading waits until it says something;
    # long after it (a notebook) the load of long ago is not today's.
    monkeypatch.setattr(threads, "_start", threads.read())
    t = time.monotonic()
    _, window = threads.others_busy()
    assert window >= threads.MIN_WINDOW_S and time.monotonic() - t >= threads.MIN_WINDOW_S * 0.9
    old = threads.Reading(time.monotonic() - 3600, 0, 0)  # an hour ago, "every core busy since"
    busy, window = threads.others_busy(since=old)
    assert threads.MIN_WINDOW_S <= window < 2 and busy < threads.usable_cores()


def test_a_users_count_is_kept_and_said_when_threads_must_wait(monkeypatch, capsys):
    before = torch.get_num_threads()
    cores = threads.usable_cores()
    monkeypatch.setattr(threads, "_torch_at_import", before)  # torch's own count, as seen at import
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert threads.apply(cores, say=True) == "OMP_NUM_THREADS=2 (yours)"
        assert torch.get_num_threads() == 2
        err = capsys.readouterr().err
        assert f"OMP_NUM_THREADS=2: 2 threads in each of {cores} process" in err and "wait for each other" in err
        assert threads.apply(cores, say=False) == "OMP_NUM_THREADS=2 (yours)" and not capsys.readouterr().err
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(before + 1)  # the user's torch.set_num_threads: neither torch's count nor ours
        said = f"torch.set_num_threads({before + 1}) (yours)"
        assert threads.apply(1) == said and torch.get_num_threads() == before + 1
        torch.set_num_threads(before)  # torch's own count: ddpkit chooses, and knows its choice after
        monkeypatch.setenv(threads.MODE, "share")
        assert "whatever the load" in threads.apply(2) and torch.get_num_threads() == max(1, cores // 2)
        assert "whatever the load" in threads.apply(2)
    finally:
        torch.set_num_threads(before)


def test_the_launchers_choice_reaches_the_workers_as_its_reason(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(threads.CHOSEN, "its share of the 2 usable cores")
    assert threads.apply(2) == "its share of the 2 usable cores"
