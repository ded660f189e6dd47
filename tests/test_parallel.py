"""tests/parallel.py: what keeps pytest-xdist's workers out of each other's way. Threads stand in
for the workers (flock locks belong to each open file, so two threads conflict as two processes
do); a config of a worker is what xdist gives one: `workerinput` and a base folder under the
run's."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests import parallel

pytestmark = pytest.mark.unit


def _worker_config(run_folder, name: str):
    return SimpleNamespace(workerinput={"workerid": name}, option=SimpleNamespace(basetemp=str(run_folder / name)))


def test_outside_xdist_nothing_is_shared_or_locked(tmp_path):
    config = SimpleNamespace(option=SimpleNamespace(basetemp=None))
    assert parallel.shared_folder(config) is None
    assert parallel.made_once(config, "x", lambda: 7) == 7
    with parallel.turn(config, alone=True), parallel.turn(config, alone=True):  # no lock to wait for
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_shared_run_is_made_by_one_worker_and_read_by_the_others(tmp_path):
    made, results = [], {}

    def make():
        made.append(1)
        time.sleep(0.3)  # the others ask meanwhile
        return {"out": tmp_path / "run", "code": 0}

    def worker(name):
        results[name] = parallel.made_once(_worker_config(tmp_path, name), "run", make)

    threads = [threading.Thread(target=worker, args=(f"gw{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(results) == 3
    assert all(r == {"out": tmp_path / "run", "code": 0} for r in results.values())


def test_a_make_that_fails_is_tried_again_by_the_next_worker(tmp_path):
    def fails():
        raise RuntimeError("no run")

    with pytest.raises(RuntimeError, match="no run"):
        parallel.made_once(_worker_config(tmp_path, "gw0"), "run", fails)
    assert parallel.made_once(_worker_config(tmp_path, "gw1"), "run", lambda: 5) == 5


def test_an_alone_test_waits_for_the_running_ones_and_later_ones_wait_for_it(tmp_path):
    events: list[str] = []
    lock = threading.Lock()

    def note(what):
        with lock:
            events.append(what)

    def run(name, alone, start_after, hold):
        time.sleep(start_after)
        with parallel.turn(_worker_config(tmp_path, name), alone=alone):
            note(f"{name} in")
            time.sleep(hold)
            note(f"{name} out")

    plan = [("a", False, 0.0, 0.6), ("b", False, 0.05, 0.6), ("alone", True, 0.2, 0.3), ("late", False, 0.4, 0.1)]
    threads = [threading.Thread(target=run, args=p) for p in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a and b share their turns; the alone test waits for both to end, and the test that asked
    # after it waits for it, not the other way round.
    assert events.index("b in") < events.index("a out")
    assert events.index("alone in") > max(events.index("a out"), events.index("b out"))
    assert events.index("alone out") + 1 == events.index("late in")
