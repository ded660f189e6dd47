"""tests/parallel.py: what keeps the processes of a `--processes` run out of each other's way.
Threads stand in for the processes (flock locks belong to each open file, so two threads conflict
as two processes do); a process's config is what `--processes` gives one: the run's shared
folder and its index. The whole (processes started, files claimed, one summary) runs for real
in test_a_run_in_two_processes_runs_each_test_once."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import parallel


def _worker_config(run_folder, name: str):
    return SimpleNamespace(option=SimpleNamespace(shard_dir=str(run_folder), shard_index=name))


@pytest.mark.unit
def test_in_one_process_nothing_is_shared_or_locked(tmp_path):
    config = SimpleNamespace(option=SimpleNamespace(shard_dir=None))
    assert parallel.shared_folder(config) is None
    assert parallel.made_once(config, "x", lambda: 7) == 7
    with parallel.turn(config, alone=True), parallel.turn(config, alone=True):  # no lock to wait for
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_in_a_process_of_several_the_files_with_an_alone_test_come_first_each_whole_and_in_order(tmp_path):
    def item(path, alone=False):
        marker = SimpleNamespace(name="alone") if alone else None
        return SimpleNamespace(path=Path(path), name=f"{path}:{alone}", get_closest_marker=lambda _: marker)

    given = [item("a"), item("a"), item("b"), item("b", alone=True), item("b"), item("c"), item("d", alone=True)]
    items = list(given)
    parallel.alone_files_first(SimpleNamespace(option=SimpleNamespace(shard_dir=None)), items)
    assert items == given  # in one process: as collected
    parallel.alone_files_first(SimpleNamespace(option=SimpleNamespace(shard_dir=str(tmp_path))), items)
    assert items == [given[2], given[3], given[4], given[6], given[0], given[1], given[5]]


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_make_that_fails_is_tried_again_by_the_next_worker(tmp_path):
    def fails():
        raise RuntimeError("no run")

    with pytest.raises(RuntimeError, match="no run"):
        parallel.made_once(_worker_config(tmp_path, "gw0"), "run", fails)
    assert parallel.made_once(_worker_config(tmp_path, "gw1"), "run", lambda: 5) == 5


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("cores,processes", [(1, 1), (2, 2), (3, 3), (16, parallel.MAX_WORKERS)])
def test_auto_runs_one_process_per_core(monkeypatch, cores, processes):
    from ddpkit.core import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert parallel.auto_workers() == processes


@pytest.mark.cli
def test_a_run_in_two_processes_runs_each_test_once_and_sums_them_up(tmp_path):
    # A small suite of its own, three files, one failing test and one `alone` test, under the
    # suite's own conftest: the run goes through the hooks `--processes auto` does.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    files = {"test_a.py": "abc", "test_b.py": "de", "test_c.py": "fg"}
    record = "    with open(os.environ['SEEN'], 'a') as f:\n        f.write(f'{__name__}.{sys._getframe().f_code.co_name} {os.getpid()}\\n')\n"
    for name, tests in files.items():
        code = "import os, sys\nimport pytest\n\npytestmark = pytest.mark.unit\n"
        code += "".join(f"\n\ndef test_{t}():\n{record}" for t in tests)
        if name == "test_b.py":
            code += "\n\n@pytest.mark.alone\ndef test_h():\n    assert 1 == 2\n"
        (suite / name).write_text(code)
    seen = tmp_path / "seen.txt"
    env = {**os.environ, "SEEN": str(seen), "PYTHONPATH": str(root)}
    # As CI runs it: no path given, the tests found from the configuration's testpaths.
    (suite / "pytest.ini").write_text(
        "[pytest]\ntestpaths = .\nmarkers =\n  unit\n  alone\naddopts = --strict-markers\n"
    )
    args = ["-q", "-p", "no:cacheprovider", "--processes", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args], capture_output=True, text=True, env=env, cwd=suite, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the failing test fails the run
    ran = [line.split()[0] for line in seen.read_text().splitlines()]
    assert sorted(ran) == sorted(f"{f[:-3]}.test_{t}" for f, tests in files.items() for t in tests), out
    by_file = {}
    for line in seen.read_text().splitlines():
        test, pid = line.split()
        by_file.setdefault(test.split(".")[0], set()).add(pid)
    assert all(len(pids) == 1 for pids in by_file.values()), by_file  # a file runs in one process
    assert "==== process 1 of 2" in out and "==== process 2 of 2" in out, out
    assert "==== all 2 processes: 1 failed, 7 passed in" in out, out


def _asked(processes: str | None) -> SimpleNamespace:
    """The config of a plain run given `--processes PROCESSES` (None: not given)."""
    flags = dict.fromkeys(("help", "version", "collectonly", "showfixtures", "show_fixtures_per_test", "markers"))
    return SimpleNamespace(option=SimpleNamespace(processes=processes, shard_dir=None, **flags))


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", "", " 2", "+2"])
def test_a_bad_count_of_processes_is_a_usage_error(bad):
    with pytest.raises(
        pytest.UsageError, match=rf"^--processes {re.escape(bad)}: give a count of processes \(1 or more\) or 'auto'$"
    ):
        parallel.wanted(_asked(bad))


@pytest.mark.unit
def test_a_count_of_processes_is_taken_as_given():
    assert [parallel.wanted(_asked(n)) for n in (None, "1", "3")] == [0, 0, 3]  # 1: a plain run, in this process
    auto = parallel.auto_workers()
    assert parallel.wanted(_asked("auto")) == (auto if auto > 1 else 0)  # one core: a plain run


@pytest.mark.cli
def test_a_bad_count_of_processes_is_one_line_and_pytests_usage_error():
    # (the values the check refuses: the unit test above; here, what pytest makes of its error)
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/test_parallel.py", "--processes=two"],
        capture_output=True, text=True, cwd=root, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "--processes two: give a count of processes (1 or more) or 'auto'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _small_suite(folder: Path, files: dict[str, str]) -> Path:
    """A suite of its own under the suite's conftest, found from its configuration's testpaths."""
    folder.mkdir()
    (folder / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (folder / "pytest.ini").write_text("[pytest]\ntestpaths = .\nmarkers =\n  unit\n  alone\n")
    for name, code in files.items():
        (folder / name).write_text("import os, time\nimport pytest\n\npytestmark = pytest.mark.unit\n" + code)
    return folder


@pytest.mark.cli
def test_sigterm_to_the_first_process_interrupts_all_and_their_fixtures_end(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    mark = tmp_path / "marks"
    mark.mkdir()
    long = (
        "\n\n@pytest.fixture\ndef held():\n    yield\n"
        "    open(os.path.join(os.environ['MARKS'], 'teardown-' + str(os.getpid())), 'w').close()\n"
        "\n\ndef test_long(held):\n"
        "    open(os.path.join(os.environ['MARKS'], 'started-' + str(os.getpid())), 'w').close()\n"
        "    time.sleep(120)\n"
    )
    # three files: a process claims the file after its current one as that one's last test starts
    suite = _small_suite(tmp_path / "suite", {"test_a.py": long, "test_b.py": long, "test_c.py": long})
    env = {**os.environ, "MARKS": str(mark), "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--processes", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=suite,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(list(mark.glob("started-*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    started = sorted(p.name.split("-")[1] for p in mark.glob("started-*"))
    if len(started) != 2:
        proc.kill()
        raise AssertionError(f"started in {started}: {proc.communicate()[0]}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "==== interrupted: the 2 processes were stopped ====" in out, out
    assert sorted(p.name.split("-")[1] for p in mark.glob("teardown-*")) == started, out  # fixtures ended
    assert not [pid for pid in started if os.path.exists(f"/proc/{pid}")], "a process outlived the run"


@pytest.mark.cli
def test_collect_only_lists_once_without_starting_processes(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    suite = _small_suite(tmp_path / "suite", {"test_a.py": "\n\ndef test_one():\n    pass\n"})
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "--processes", "2"],
        capture_output=True, text=True, env=env, cwd=suite, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("test_a.py::test_one") == 1 and "processes at once" not in proc.stdout, proc.stdout
