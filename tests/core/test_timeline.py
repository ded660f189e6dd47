"""`timeline`: the moments of a run in seconds since the process started, and the phases
between them."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import pytest

from ddpkit.launcher.workers import gc_frozen
from ddpkit.observe import timeline
from ddpkit.observe.timeline import MOMENTS, Timeline, gc_paused, phases, process_start


@pytest.mark.unit
def test_process_start_is_this_process_start_on_the_monotonic_clock():
    start = process_start()
    assert abs(process_start() - start) < 0.011  # read again: the same, to the 10 ms tick
    assert start <= timeline._IMPORTED_AT  # before ddpkit was imported


@pytest.mark.cli
def test_process_start_counts_what_ran_before_ddpkit_was_imported():
    # A fresh interpreter sleeps 0.5 s before importing ddpkit: the start it reads is before
    # the sleep, and not before the parent launched it.
    launched = time.monotonic()
    code = (
        "import time; before = time.monotonic(); time.sleep(0.5); "
        "from ddpkit.observe.timeline import process_start; print(before - process_start())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lead = float(out.stdout)  # from the process's start to its first line of Python
    assert 0 <= lead < time.monotonic() - launched - 0.5 + 0.011


@pytest.mark.unit
def test_moments_are_kept_once_in_order_and_phases_add_up():
    t = Timeline(origin=100.0)
    t.mark("model_ready", at=103.0)
    t.mark("imports_done", at=101.5)
    t.mark("imports_done", at=102.0)  # a moment is kept once: the first
    t.mark("workers_exited", at=104.25)
    assert list(t.seconds()) == ["imports_done", "model_ready", "workers_exited"]  # MOMENTS' order
    assert t.seconds() == {"imports_done": 1.5, "model_ready": 3.0, "workers_exited": 4.25}
    assert phases(t.seconds()) == {"imports_done": 1.5, "model_ready": 1.5, "workers_exited": 1.25}
    with pytest.raises(ValueError, match="unknown moment 'nosuch'"):
        t.mark("nosuch")
    assert list(MOMENTS)[0] == "imports_done" and list(MOMENTS)[-2:] == ["workers_exited", "curves_drawn"]


@pytest.mark.unit
def test_gc_paused_freezes_what_was_made_and_restores_collections():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with gc_paused():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
        assert timeline.froze_objects()  # what gc_frozen asks before each launch
        with gc_frozen():  # the caller froze objects: they stay frozen after the launch
            pass
        assert gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()  # this test process goes on: its objects go back to the collector
        timeline._froze = False
