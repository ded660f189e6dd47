"""`ddpkit bench startup` as a real command at --quick size: one short `ddpkit train --nproc 2`
whose start-up breakdown is read from its results.json and timed from outside."""

from __future__ import annotations

import pytest

from ddpkit.observe.timeline import MOMENTS
from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = pytest.mark.cli


def test_startup(tmp_path):
    r = run_bench(tmp_path, "startup", "--epochs", "1")
    assert r["epochs"] == 1 and r["processes"] == 2 and r["repetitions"] == 1 and r["warmup_runs"] == 0
    assert positive_stats(r["whole_seconds"]) and r["whole_seconds"]["n"] == 1
    (run,) = r["runs"]
    assert run["test_accuracy"] > 0.5  # it trained, not merely started
    # every moment of a 2-process run, in order, then the exit seen from outside
    assert list(r["phases"]) == [*MOMENTS, "exit"] == list(run["phases"])
    # curves_drawn waits for the drawing only if it outlasted the workers: 0.0 s (to the timeline's 0.1 ms)
    # when it ended first, as it often does; every other phase takes time
    assert all(positive_stats(s) for name, s in r["phases"].items() if name != "curves_drawn")
    assert r["phases"]["curves_drawn"]["min"] >= 0
    marks = list(run["timeline"].values())
    assert marks == sorted(marks) and marks[-1] < run["seconds"]
    # the phases tile the whole command: from the process's start to its exit
    assert sum(run["phases"].values()) == pytest.approx(run["seconds"], abs=1e-6)
