"""Shared fixtures and helpers. Every test starts with no launcher/SLURM variables and no process
group, so one test's distributed state never leaks into the next.

Every test is marked with its kind (see pyproject.toml): `unit` (one process, no subprocess, no
launched workers), `distributed` (real gloo processes through ddpkit.launch) or `cli` (real
subprocesses of `python -m ddpkit` or `python -m benchmarks`), and `slow` besides when it takes
more than about ten seconds. Collection fails on a test without a kind, so
`python -m pytest -m unit` runs every fast test there is.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

# The suite's runs take their share of the cores whatever else the machine does (ddpkit would
# otherwise give fewer threads to a run started while another test's processes are busy, and the
# thread count changes the last bits that bit-identity tests compare). tests/core/test_threads.py
# and tests/cli/test_threads.py run the choice by load itself.
os.environ.setdefault("DDPKIT_THREADS", "share")
# So two tests' runs may share a core (under --processes: tests/parallel.py), and a waiting OpenMP
# thread of one must not spin through the other's time: GNU OpenMP's default spins 300,000 times
# before it sleeps. Two small runs of 2 threads at once on 2 cores took 18 and 20 s where each
# alone takes 3.5 (a dropout benchmark's and a `ddpkit train`'s); with 3,000 spins, 5 and 6 s, and
# alone the same 3.5. Set before torch loads (the imports below load it): OpenMP reads it then,
# and every process the tests start inherits it.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from ddpkit.core.dist import LAUNCH_VARS, environ_outside_job  # noqa: E402 (after the variables above)
from tests import cli_server, parallel, slowest  # noqa: E402

KINDS = ("unit", "distributed", "cli")


def pytest_addoption(parser):
    parser.addoption(
        "--slowest-into",
        metavar="FILE",
        help="after a whole run that passed, write its ten slowest tests, and the ten that used the most CPU, into "
        "FILE's generated block "
        "(docs/testing.md; see tests/slowest.py). Defined here: name the tests folder, "
        "`python -m pytest tests --slowest-into docs/testing.md`",
    )
    parallel.add_options(parser)


_SECONDS: dict[str, float] = {}  # each test's setup, call and teardown, for --slowest-into
_CPU: dict[str, float] = {}  # each test's CPU time, with the processes it waited for (slowest.cpu_now)
_PASSED: list[str] = []
_STARTED: list[float] = []


def pytest_sessionstart(session):
    import time

    _STARTED.append(time.time())
    cli_server.start_with(clean_env())  # the session's environment, before any test changes it


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" and report.passed:
        _PASSED.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    said = cli_server.summary()
    if said:
        terminalreporter.write_line(said)


def pytest_sessionfinish(session, exitstatus):
    cli_server.close()  # its CPU time into this process's, before it is summed
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    parallel.leave_results(config, reporter.stats if reporter else {}, _SECONDS, _CPU)  # (one of several processes)
    if exitstatus == 0 and not parallel.shared_folder(config):
        import time

        _write_slowest(config, _SECONDS, _CPU, time.time() - _STARTED[0], slowest.cpu_now(), len(_PASSED), 0)


def _write_slowest(
    config,
    seconds: dict[str, float],
    cpu: dict[str, float],
    total: float,
    cpu_total: float,
    passed: int,
    processes: int,
) -> None:
    """--slowest-into FILE: after a whole run that passed, its ten slowest tests and the ten that
    used the most CPU into FILE."""
    path = config.getoption("--slowest-into")
    whole = not config.getoption("markexpr") and not config.getoption("keyword")
    whole = whole and all(os.path.abspath(a) in (ROOT, os.path.join(ROOT, "tests")) for a in config.args)
    if not path or not whole or config.option.collectonly:
        return  # (a part of the suite says nothing of the whole's slowest)
    import datetime

    slowest.write_into(path, slowest.block(seconds, cpu, total, cpu_total, passed, datetime.date.today(), processes))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`--processes N`: the session in N pytest processes at once (tests/parallel.py)."""
    if parallel.wanted(config):
        return parallel.run(config, lambda *measured: _write_slowest(config, *measured))
    return None


def pytest_configure(config):
    if parallel.shared_folder(config):
        config.pluginmanager.register(parallel.Unclaimed(), "unclaimed test files")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not parallel.claimed(item):
        return (yield)
    with parallel.turn(item.config, alone=item.get_closest_marker("alone") is not None):
        before = slowest.cpu_now()
        result = yield
        _CPU[item.nodeid] = slowest.cpu_now() - before
    parallel.note_done(item.config)
    return result


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    unclassified = [item.nodeid for item in items if not any(item.get_closest_marker(k) for k in KINDS)]
    mixed = [
        item.nodeid
        for item in items
        if item.get_closest_marker("unit") and any(item.get_closest_marker(k) for k in ("distributed", "cli", "slow"))
    ]
    problems = [f"{nodeid}: no kind (mark it unit, distributed or cli)" for nodeid in unclassified]
    problems += [f"{nodeid}: unit, yet marked distributed, cli or slow as well" for nodeid in mixed]
    if problems:
        raise pytest.UsageError("tests/conftest.py: unclassified tests:\n" + "\n".join(problems))
    parallel.alone_files_first(config, items)


@pytest.fixture(autouse=True)
def clean_dist_env(monkeypatch):
    for name in list(os.environ):
        if name in LAUNCH_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")


def clean_env() -> dict:
    """This process's environment without launcher or SLURM variables: a fresh job's."""
    return environ_outside_job()


def run_helper(module: str, cases: list[dict], timeout: float, path: str = "") -> list[dict]:
    """`python -m MODULE` (a helper that runs many cases in one interpreter: tests/cli/argv_runner.py,
    tests/docs/program_runner.py) with `cases` as JSON on its stdin, from the repository, with
    `path` (if any) and the repository on its PYTHONPATH; the outcomes it prints as JSON. Forked
    from the tests' command server as `run_cli`'s commands are, `path` and the repository put
    on its `sys.path` where a fresh interpreter puts them (tests/cli_server.py)."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, ROOT, env.get("PYTHONPATH", "")]))
    proc = cli_server.run(module, [], env, cwd=ROOT, stdin=json.dumps(cases), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def run_cli(
    *args: str,
    timeout: float = 240,
    env: dict | None = None,
    cwd: str | None = None,
    stdin: str | None = None,
    module: str = "ddpkit",
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `python -m ddpkit ARGS...` (or another module: `benchmarks` runs from the repository
    root) as a real subprocess; returns the completed process. Forked from the tests' command
    server, which imported torch once, where the environment allows (tests/cli_server.py); else,
    or if `fresh`, a fresh interpreter."""
    full_env = clean_env()
    full_env.update(env or {})
    return cli_server.run(module, args, full_env, cwd=cwd, stdin=stdin, timeout=timeout, fresh=fresh)


def start_cli(*args: str, env: dict | None = None, fresh: bool = False, **kwargs) -> subprocess.Popen:
    """`python -m ddpkit ARGS...` started in the background: `subprocess.Popen` with `kwargs`
    (stdin, stdout, stderr, text, cwd, start_new_session), forked from the tests' command server
    where the environment allows, as `run_cli` does; else, or if `fresh`, a fresh interpreter."""
    full_env = clean_env()
    full_env.update(env or {})
    return cli_server.popen("ddpkit", args, full_env, fresh=fresh, **kwargs)


def run_comparison(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGS...` from the repository root: the comparison benchmarks."""
    return run_cli(*args, timeout=timeout, cwd=ROOT, module="benchmarks")


@pytest.fixture
def cli():
    return run_cli


def run_train(tmp_path, name, *extra):
    """`ddpkit train --device cpu --out TMP/NAME EXTRA...`; returns (results.json, model.pt's
    state dict, the out directory)."""
    import torch

    out = tmp_path / name
    proc = run_cli("train", "--device", "cpu", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), torch.load(out / "model.pt", weights_only=True), out


def stderr_on_a_terminal(args: list[str]) -> tuple[str, str]:
    """Run `python -m ddpkit ARGS` with its stderr on a pseudo-terminal (where the progress bar
    shows); returns what it wrote to stdout and to the terminal."""
    parent, child = pty.openpty()
    # A new terminal is 0 columns wide, and tqdm draws a bar of that width: nothing.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args], stdout=subprocess.PIPE, stderr=child, env=clean_env()
    )
    os.close(child)
    seen = []
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # EIO: the program's end of the terminal is closed
            break
        if not chunk:
            break
        seen.append(chunk)
    os.close(parent)
    stdout = proc.stdout.read().decode()
    assert proc.wait(timeout=300) == 0, b"".join(seen).decode(errors="replace")[-3000:]
    return stdout, b"".join(seen).decode(errors="replace")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(tmp_path, name: str, *flags: str, timeout: float = 300, comparison: bool = False) -> dict:
    """`ddpkit bench NAME --quick --repeats 1` (or `python -m benchmarks NAME ...` for a
    comparison) on CPU as a subprocess; checks the PNG and the record's metadata, returns the
    benchmark's result payload."""
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    args = (
        name,
        "--device",
        "cpu",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        *flags,
    )
    proc = run_comparison(*args, timeout=timeout) if comparison else run_cli("bench", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = out_png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000, f"{out_png} is not a drawn PNG"
    record = json.loads(out_json.read_text())
    assert record["benchmark"] == name and record["device"] == "cpu" and record["versions"]["torch"]
    return record["result"]


HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


TENSORBOARD = ["--tensorboard"] if HAVE_TENSORBOARD else []


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, pytestconfig):
    """`ddpkit train --epochs 2 --nproc 2 --device cpu --out DIR` (with --tensorboard when it is
    installed): 46 steps on digits, made once per session and read by every test that needs
    this run: cli/test_train.py and cli/test_bad_input.py (as `run1`), the trainer's invariance
    and resume tests (as `straight`), the outputs and report tests (as run A of `runs`), and
    the two-host test (launcher/test_multinode.py) as the one-host run it compares with.
    Returns (out directory, the completed process); no test writes in it (those that continue
    the run copy it first). Made once per run of the suite, however many workers it has
    (tests/parallel.py), as are the other shared runs below."""

    def make():
        root = tmp_path_factory.mktemp("two_process_run")
        out = root / "out"
        args = ("--epochs", "2", "--nproc", "2", "--device", "cpu", "--out", str(out), *TENSORBOARD)
        # a fresh interpreter, as a user starts it: the session's one run whose timeline starts
        # before torch is imported (the other command lines are forked: tests/cli_server.py)
        return out, run_cli("train", *args, cwd=str(root), fresh=True)

    return parallel.made_once(pytestconfig, "two_process_run", make)


@pytest.fixture(scope="session")
def fsdp_two_process_run(tmp_path_factory, pytestconfig):
    """`two_process_run` under `--strategy fsdp`: `ddpkit train --epochs 2 --nproc 2 --strategy
    fsdp --device cpu --out DIR`, 46 steps on digits, made once per session: the uninterrupted
    fsdp run that the invariance test (trainer/test_invariance.py) and the SIGKILL test under
    fsdp (launcher/test_faults.py) compare with. Returns (out directory, the completed process)."""

    def make():
        out = tmp_path_factory.mktemp("fsdp_two_process_run") / "out"
        args = ("--epochs", "2", "--nproc", "2", "--strategy", "fsdp", "--device", "cpu", "--out", str(out))
        return out, run_cli("train", *args)

    return parallel.made_once(pytestconfig, "fsdp_two_process_run", make)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory, pytestconfig):
    """`ddpkit train --nproc 1 --device cpu --out DIR`: the default recipe (10 epochs of digits)
    on one process, made once per session for the test of its accuracy (cli/test_train.py) and
    as run B of `runs`. Returns (out directory, the completed process)."""

    def make():
        root = tmp_path_factory.mktemp("default_run")
        out = root / "out"
        return out, run_cli("train", "--nproc", "1", "--device", "cpu", "--out", str(out), cwd=str(root))

    return parallel.made_once(pytestconfig, "default_run", make)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, two_process_run, default_run):
    """Two real runs, for the tests of their outputs (trainer/test_outputs.py) and of `ddpkit
    report` (cli/test_report.py): A, 2 epochs on 2 processes (with --tensorboard when it is
    installed: `two_process_run`), and B, the default 10 epochs on one (`default_run`). Returns
    a folder for the tests' own files, then (A, its process) and (B, its process)."""
    for _, proc in (two_process_run, default_run):
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path_factory.mktemp("runs"), two_process_run, default_run


@pytest.fixture(scope="session")
def one_epoch_run(tmp_path_factory, pytestconfig):
    """`ddpkit train --epochs 1 --nproc 1 --device cpu --log-every 5 --checkpoint-every 5
    --keep-checkpoints 3 --out DIR` with its stderr on a pseudo-terminal: 23 steps on digits,
    checkpoints at steps 5, 10, 15, 20 and the epoch's end (23), the newest three kept. Made once
    per session for the tests of the progress bar and the printed summary
    (trainer/test_reports.py), as `three_checkpoints` (tests/trainer/conftest.py) and as the plain
    run that --channels-last is compared with (test_runtime.py): neither the terminal nor the
    logging and checkpoint flags change what is trained. Returns (out directory, its stdout, what
    its terminal showed); no test writes in it (those that continue the run copy it first)."""

    def make():
        out = tmp_path_factory.mktemp("one_epoch_run") / "out"
        args = ["train", "--epochs", "1", "--nproc", "1", "--device", "cpu", "--log-every", "5"]
        args += ["--checkpoint-every", "5", "--keep-checkpoints", "3", "--out", str(out)]
        stdout, terminal = stderr_on_a_terminal(args)
        return out, stdout, terminal

    return parallel.made_once(pytestconfig, "one_epoch_run", make)


@pytest.fixture(scope="session")
def jobs_started_together(tmp_path_factory, pytestconfig):
    """Two `ddpkit train --epochs 1 --nproc 2 --device cpu --out DIR` jobs started at the same
    moment on this machine, the second with --compile: the two jobs that must not collide
    (launcher/test_topology.py), and the eager and the compiled run that must train alike
    (trainer/test_reports.py). Returns {"eager": (out, completed process), "compiled": ...}."""

    def make():
        root = tmp_path_factory.mktemp("together")
        args = ("train", "--epochs", "1", "--nproc", "2", "--device", "cpu")
        jobs = {name: (root / name, extra) for name, extra in (("eager", ()), ("compiled", ("--compile",)))}
        procs = {
            name: start_cli(*args, "--out", str(out), *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, (out, extra) in jobs.items()
        }
        done = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            done[name] = jobs[name][0], subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        return done

    return parallel.made_once(pytestconfig, "jobs_started_together", make)
