"""The suite on several cores: `python -m pytest --processes auto` runs it in one pytest process
per usable core (at most MAX_WORKERS; see `auto_workers`), each taking whole test files as it
comes to them, so a module's shared runs are made once and the processes end about together.

Why processes of our own and not pytest-xdist's workers: an xdist worker runs execnet's receiver
thread, and ddpkit never forks its workers from a process with another thread (a process forked
from an xdist worker once crashed collecting garbage), so under xdist every launch spawns fresh
interpreters, four times slower. These processes are plain `python -m pytest` runs, with no
thread but their own: they fork as the one-at-a-time suite does.

How they share the run (a folder of the run, `--shard-dir`):

- each test file runs in the process that claims it first (`claims/`, an O_EXCL file each);
- `made_once`: a run that tests in several files read (the session's `two_process_run`, say) is
  made by the first process that asks for it; the others wait for it and read the same result
  (NAME.lock, NAME.pickle);
- the `alone` marker: a test whose assertions read the machine's load or time a short operation
  (the thread choice, a bound in milliseconds) runs while no other process runs a test. Every
  other test holds a shared turn, an `alone` test the only one: a readers-writer lock over two
  files (fcntl.flock, `gate` and `turn`), where a waiting `alone` test holds the gate, so later
  tests queue behind it instead of starving it;
- each process leaves its outcomes, test times and tests' CPU times (`results-K.json`); the
  first process, which started the others, prints their outputs and one summary (with the CPU
  time the whole run used), and writes `--slowest-into`.

Without `--processes` (or with one usable core) none of this does anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.slowest import cpu_now

MAX_WORKERS = 4  # `--processes auto`: one per usable core, at most this many
OUTCOMES = ("failed", "passed", "skipped", "xfailed", "xpassed", "error")
_CLAIMS = pytest.StashKey[dict]()  # this process's test files: path -> whether it runs them
_INDEX = pytest.StashKey[dict]()  # id(item) -> its place in the session's items


def auto_workers() -> int:
    """The number of processes `--processes auto` runs: one per core this process may use (its
    affinity, a cgroup's quota), at most MAX_WORKERS. One more than the cores ran a whole run on
    2 cores in 12.1 and 12.5 minutes instead of 13.2, for the same CPU time (the cores sat idle
    15% of a run), but the heavier load failed two tests in the next run (a hang test's 90-s
    limit, and a trace's forked process crashing in garbage collection), and a third lost its
    torchrun contender in another: not worth a CI that fails (docs/testing.md)."""
    from ddpkit.core.threads import usable_cores

    return max(1, min(usable_cores(), MAX_WORKERS))


def add_options(parser) -> None:
    parser.addoption(
        "--processes",
        metavar="N",
        help="run the test files in N pytest processes at once ('auto': one per usable core, at most "
        f"{MAX_WORKERS}); see tests/parallel.py",
    )
    parser.addoption("--shard-dir", help="(set by --processes for the processes it starts)")
    parser.addoption("--shard-index", type=int, default=0, help="(set by --processes)")


def shared_folder(config) -> Path | None:
    """The folder the processes of a `--processes` run share; None in a run of one process."""
    folder = getattr(config.option, "shard_dir", None)
    return Path(folder) if folder else None


def wanted(config) -> int:
    """How many processes this run asks for (0: none of ours; this is one of them, or a plain run)."""
    asked = getattr(config.option, "processes", None)
    if asked is None or shared_folder(config) is not None:
        return 0
    o = config.option
    if o.help or o.version or o.collectonly or o.showfixtures or o.show_fixtures_per_test or o.markers:
        return 0  # nothing runs: one process says it
    if asked == "auto":
        n = auto_workers()
    elif asked.isdigit() and int(asked) > 0:
        n = int(asked)
    else:
        raise pytest.UsageError(f"--processes {asked}: give a count of processes (1 or more) or 'auto'")
    return n if n > 1 else 0


def claimed(item) -> bool:
    """Whether this process runs `item`: its file is claimed by this process, or by none yet
    (then this process claims it now). Outside a `--processes` run, every item is."""
    folder = shared_folder(item.config)
    if folder is None:
        return True
    mine = item.config.stash.setdefault(_CLAIMS, {})
    path = str(item.path)
    if path not in mine:
        name = folder / "claims" / path.replace(os.sep, "%")
        try:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            mine[path] = True
        except FileExistsError:
            mine[path] = False
    return mine[path]


class Unclaimed:
    """In each process of a `--processes` run: a test whose file another process claimed is
    not run here (nothing is reported for it: the other process reports it). A test that runs
    is run as pytest's own protocol runs it, with the next test that runs *here* as the one its
    teardown prepares for (so that a module's or a folder's fixtures end with the last of its
    tests here): that claims the next file at the end of the current one."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        from _pytest.runner import runtestprotocol  # (pytest's own protocol, what its main calls)

        if not claimed(item):
            return True
        items = item.session.items
        where = item.config.stash.setdefault(_INDEX, {})
        if not where:
            where.update({id(it): i for i, it in enumerate(items)})
        later = (items[i] for i in range(where[id(item)] + 1, len(items)))
        nextitem = next((it for it in later if claimed(it)), None)
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runtestprotocol(item, nextitem=nextitem)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


def alone_files_first(config, items: list) -> None:
    """In a process of a `--processes` run: the test files that hold an `alone` test first (in
    their order, then the others in theirs; each file's tests stay together, in order). An
    `alone` test waits for the test each other process is running to end, and a core idles
    meanwhile: at the start, those are the other such files' tests (seconds at most); later
    they may be runs of a minute."""
    if shared_folder(config) is None:
        return
    alone = {item.path for item in items if item.get_closest_marker("alone") is not None}
    items.sort(key=lambda item: item.path not in alone)  # (stable: each file's tests stay in order)


def note_done(config) -> None:
    """One more test run by this process (for the first process's progress line)."""
    folder = shared_folder(config)
    if folder is not None:
        with open(folder / f"done-{config.option.shard_index}", "a") as f:
            f.write(".")


def leave_results(config, stats: dict[str, list], seconds: dict[str, float], cpu: dict[str, float]) -> None:
    """This process's outcomes (pytest's terminal statistics, counted), test times and tests'
    CPU times, for the first process."""
    folder = shared_folder(config)
    if folder is not None:
        counts = {key: len(stats.get(key, [])) for key in OUTCOMES}
        left = folder / f"results-{config.option.shard_index}.json"
        left.write_text(json.dumps({"counts": counts, "seconds": seconds, "cpu": cpu}))


def run(config, write_slowest: Callable[..., None] | None) -> int:
    """Run the session in `wanted(config)` processes: start them, show progress, then each one's
    output and one summary. Returns the exit code: the first failing process's (3 for one that
    died of a signal), else 0. Ctrl-C or SIGTERM here interrupts every process as Ctrl-C does
    one (its fixtures torn down), SIGKILL after GRACE_S, and returns pytest's 2."""
    n = wanted(config)
    started = time.time()
    folder = Path(tempfile.mkdtemp(prefix="pytest-processes-"))
    (folder / "claims").mkdir()
    procs: list[subprocess.Popen] = []
    outs: list[Any] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for k in range(n):
            out = open(folder / f"output-{k}.txt", "w+")  # noqa: SIM115 - read back below
            outs.append(out)
            # Ours first, the command line's after (its `--` would make ours paths). `--option=value`:
            # before the conftest that defines an option is loaded, pytest would take a separate
            # value for a path, and look for the rootdir there.
            ours = [f"--shard-dir={folder}", f"--shard-index={k}", f"--basetemp={folder / f'tmp-{k}'}",
                    "-p", "no:cacheprovider"]  # fmt: skip
            cmd = [sys.executable, "-m", "pytest", *ours, *_without_processes(config.invocation_params.args)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=config.invocation_params.dir, start_new_session=True))  # fmt: skip
        print(f"tests in {n} processes at once (tests/parallel.py): their outputs follow as each ends", flush=True)
        _follow(procs, outs, folder, started)
    except KeyboardInterrupt:
        _stop(procs)
        _show(procs, outs, set())
        print(f"\n==== interrupted: the {n} processes were stopped ====", flush=True)
        return 2  # pytest's ExitCode.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        for out in outs:
            out.close()
        if any(p.poll() is None for p in procs):  # (an error of this function's own)
            _stop(procs)
    counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    missing = []
    for k in range(n):
        try:
            left = json.loads((folder / f"results-{k}.json").read_text())
        except (OSError, ValueError):
            missing.append(k + 1)
            continue
        for key, value in left["counts"].items():
            counts[key] = counts.get(key, 0) + value
        seconds.update(left["seconds"])
        cpu.update(left.get("cpu", {}))
    total = time.time() - started
    cpu_total = cpu_now()  # this process's, and the processes' (waited for above) with all they waited for
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    print(
        f"\n==== all {n} processes: {summary or 'nothing ran'} in {total:.1f}s ({total / 60:.1f} min), "
        f"{cpu_total / 60:.1f} min of CPU ===="
    )
    codes = [3 if p.returncode < 0 else p.returncode for p in procs]  # a signal: an internal error
    code = next((c for c in codes if c not in (0, 5)), 0 if any(c == 0 for c in codes) else codes[0])
    if missing:
        print(f"process(es) {missing} left no results (the test files they claimed did not all run): see above")
        code = code or 3
    if code == 0 and write_slowest is not None:
        write_slowest(seconds, cpu, total, cpu_total, counts["passed"], n)
    shutil.rmtree(folder, ignore_errors=True)
    return code


GRACE_S = 20.0  # after an interrupt, how long the processes get to tear their fixtures down


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _follow(procs: list[subprocess.Popen], outs: list[Any], folder: Path, started: float) -> None:
    """Wait for every process, printing each one's output as it ends and a progress line a minute."""
    shown: set[int] = set()
    said = time.monotonic()
    while len(shown) < len(procs):
        time.sleep(0.5)
        _show(procs, outs, shown)
        if time.monotonic() - said > 60 and len(shown) < len(procs):
            said = time.monotonic()
            done = sum(_size(folder / f"done-{k}") for k in range(len(procs)))
            print(f"... {done} tests done after {(time.time() - started) / 60:.1f} min", flush=True)


def _show(procs: list[subprocess.Popen], outs: list[Any], shown: set[int]) -> None:
    for k, proc in enumerate(procs):
        if k not in shown and proc.poll() is not None:
            shown.add(k)
            outs[k].seek(0)
            print(f"\n==== process {k + 1} of {len(procs)} (exit code {proc.returncode}) ====", flush=True)
            sys.stdout.write(outs[k].read())
            sys.stdout.flush()


def _stop(procs: list[subprocess.Popen]) -> None:
    """Interrupt each process as Ctrl-C would (its session: what its tests started too), and
    SIGKILL what is left after GRACE_S."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _without_processes(args) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--processes":
            skip = True
            continue
        if a.startswith("--processes="):
            continue
        out.append(a)
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@contextlib.contextmanager
def turn(config, alone: bool):
    """Hold this process's turn to run a test: shared, or the only one when `alone`."""
    folder = shared_folder(config)
    if folder is None:
        yield
        return
    with open(folder / "gate", "a") as gate, open(folder / "turn", "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)  # queue: an `alone` test waiting here keeps it
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


def made_once(config, name: str, make: Callable[[], Any]) -> Any:
    """`make()`'s result, made by one process of the run and read by the others (in one process,
    simply made). It must pickle, and its files must live under tmp_path_factory's folders, which
    stay until the run is over (the first process removes the run's folder at its end). A `make`
    that raises leaves nothing behind: the next process to ask tries again, and fails with its
    own error."""
    shared = shared_folder(config)
    if shared is None:
        return make()
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        result = make()
        partial = done.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(result))
        os.replace(partial, done)  # whole or not there, even if this process dies writing it
        return result
