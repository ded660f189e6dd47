"""The tests' command server (tests/cli_server.py), which `run_cli` forks command lines from: a
command line forked from it ends as the same command line run as a fresh interpreter does (its
exit code, its output, its timeout), and those whose environment it cannot honour are not forked."""

import os
import signal
import subprocess
import sys

import pytest

from tests import cli_server
from tests.conftest import ROOT, clean_env

CASES = [
    ("where",),
    ("exit", "3"),
    ("exit", "a message instead of a code"),
    ("raise", "what went wrong"),
    ("interrupt",),
    ("signal",),
    ("late",),
    ("hangup",),
]


@pytest.fixture(scope="module")
def server():
    env = clean_env()
    server = cli_server._Server(env)
    yield server
    server.close()


def _both(server, args, env, cwd, stdin=None, timeout=60):
    fresh = subprocess.run(
        [sys.executable, "-m", "tests.forked_program", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        input=stdin,
        timeout=timeout,
    )
    return fresh, server.run("tests.forked_program", args, env, cwd, stdin, timeout)


@pytest.mark.cli
@pytest.mark.parametrize("args", CASES, ids=lambda a: " ".join(a))
def test_a_forked_command_ends_as_a_fresh_interpreter_running_it_does(server, args, tmp_path):
    env = {**server.env, "DDPKIT_TEST_WORD": "forked or not", "TMPDIR": str(tmp_path)}
    fresh, forked = _both(server, args, env, cwd=ROOT, stdin="what stdin held\n")
    assert forked.returncode == fresh.returncode, (fresh, forked)
    assert forked.stdout == fresh.stdout
    if args[0] in ("raise", "interrupt"):  # a traceback: the runner's frames differ, its last line not
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], (fresh.stderr, forked.stderr)
        assert forked.stderr.startswith("Traceback (most recent call last):")
    else:
        assert forked.stderr == fresh.stderr
    said = {"where": "forked or not", "exit": "leaving", "late": "at exit in forked_program.py", "hangup": ""}
    assert said.get(args[0], "") in forked.stdout


@pytest.mark.cli
@pytest.mark.cli
def test_a_forked_command_inherits_the_ignored_signals_of_the_test_process_as_a_fresh_one_does(server):
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        fresh, forked = _both(server, ("hangup",), server.env, cwd=ROOT)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout) == (0, "still here\n")


@pytest.mark.cli
def test_each_forked_command_draws_its_own_random_numbers_as_a_new_process_does(server):
    draws = {server.run("tests.forked_program", ("numpy",), server.env, ROOT, None, 60).stdout for _ in range(2)}
    assert len(draws) == 2, draws


@pytest.mark.cli
def test_a_forked_command_past_its_timeout_is_killed_with_what_it_wrote(server):
    for run in _run_fresh, server.run:
        with pytest.raises(subprocess.TimeoutExpired) as caught:
            run("tests.forked_program", ("sleep", "60"), server.env, ROOT, None, 1.5)
        assert (caught.value.stdout, caught.value.stderr) == (b"sleeping\n", None), caught.value
    done = server.run("tests.forked_program", ("exit", "0"), server.env, ROOT, None, 60)  # and it serves on
    assert (done.returncode, done.stdout) == (0, "leaving\n")


def _started_both(server, args, **kwargs):
    """`python -m tests.forked_program ARGS` started both ways: (a fresh Popen, a Forked one)."""
    fresh = subprocess.Popen([sys.executable, "-m", "tests.forked_program", *args], env=server.env, cwd=ROOT, **kwargs)
    return fresh, cli_server.Forked(server, "tests.forked_program", args, env=server.env, cwd=ROOT, **kwargs)


@pytest.mark.cli
def test_a_command_started_forked_is_a_popen_as_a_fresh_ones_is(server):
    # pipes read as it runs, poll and wait with a timeout, a signal by its pid, its exit code
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    for proc in _started_both(server, ("sleep", "60"), **pipes):
        assert proc.stdout.readline() == "sleeping\n"  # running, its output streamed
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
        assert proc.communicate(timeout=5) == ("", "")
    fresh, forked = _started_both(server, ("exit", "a message"), **pipes)
    assert forked.communicate(timeout=30) == fresh.communicate(timeout=30) == ("leaving\n", "a message\n")
    assert forked.returncode == fresh.returncode == 1
    fresh, forked = _started_both(server, ("where",), stdin=subprocess.PIPE, **pipes)
    said = forked.communicate("fed\n", timeout=30)
    assert said == fresh.communicate("fed\n", timeout=30) and "'fed\\n'" in said[0]
    assert forked.returncode == fresh.returncode == 0


@pytest.mark.cli
def test_forked_commands_run_at_once_each_ending_when_it_does(server):
    # several at once, each in a session of its own; the last started ends first
    slow, fast = (
        cli_server.Forked(server, "tests.forked_program", ("sleep", s), env=server.env, cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
        for s in ("3", "0.1")
    )  # fmt: skip
    assert fast.wait(30) == 0 and slow.poll() is None
    assert os.getsid(slow.pid) == slow.pid != os.getsid(0)
    assert slow.wait(30) == 0
    assert (slow.stdout.read(), fast.stdout.read()) == ("sleeping\n", "sleeping\n")
    killed = cli_server.Forked(server, "tests.forked_program", ("sleep", "60"), env=server.env, cwd=ROOT,
                               stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    killed.stdout.readline()
    os.killpg(killed.pid, signal.SIGKILL)  # its group: the command alone, not the server
    assert killed.wait(30) == -signal.SIGKILL
    killed.stdout.close()
    done = server.run("tests.forked_program", ("exit", "0"), server.env, ROOT, None, 60)  # the server serves on
    assert (done.returncode, done.stdout) == (0, "leaving\n")


@pytest.mark.unit
def test_a_forked_command_refuses_what_the_server_cannot_give_it():
    with pytest.raises(TypeError, match=r"takes no \['pass_fds'\]: pass fresh=True"):
        cli_server.popen("ddpkit", ("--version",), dict(cli_server._environment), pass_fds=(5,))


@pytest.mark.cli
def test_a_forked_command_finds_the_folders_pythonpath_puts_first_where_a_fresh_one_does(server, tmp_path):
    (tmp_path / "own_module.py").write_text("WHERE = 'the folder put first'\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), ROOT, server.env.get("PYTHONPATH")]))
    fresh, forked = _both(server, ("path",), {**server.env, "PYTHONPATH": path}, cwd=str(tmp_path.parent))
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), (fresh, forked)
    assert forked.stdout == f"{[str(tmp_path.parent), str(tmp_path), ROOT]} the folder put first\n"


def _run_fresh(module, args, env, cwd, stdin, timeout):
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, input=stdin, timeout=timeout)


@pytest.mark.unit
def test_only_what_a_command_reads_as_it_runs_may_differ_from_the_servers_environment(monkeypatch):
    monkeypatch.delenv("TESTS_CLI_EXEC", raising=False)
    env = dict(cli_server._environment)  # the session's, which the server starts with
    assert cli_server.forkable("ddpkit", env)
    assert cli_server.forkable("ddpkit", {**env, "DDPKIT_THREADS": "4", "COLUMNS": "200"})
    for read_at_import in ("OMP_NUM_THREADS", "TORCH_LOGS", "LD_PRELOAD", "TMPDIR"):
        assert not cli_server.forkable("ddpkit", {**env, read_at_import: "7"}), read_at_import
    assert not cli_server.forkable("ddpkit", {k: v for k, v in env.items() if k != "PATH"})  # one gone
    assert not cli_server.forkable("pytest", env)  # only ddpkit's command and the benchmarks
    # PYTHONPATH may put folders first (a fresh interpreter and the fork put them right after the
    # working directory), not drop or reorder the session's
    monkeypatch.setitem(cli_server._environment, "PYTHONPATH", os.pathsep.join(["/s", "/t"]))
    env = dict(cli_server._environment)
    for path, forked in (("/a:/b:/s:/t", True), ("/s:/t", True), ("/s:/t:/a", False), ("/a:/t", False), ("", False)):
        assert cli_server.forkable("ddpkit", {**env, "PYTHONPATH": path.replace(":", os.pathsep)}) is forked, path
    monkeypatch.setenv("TESTS_CLI_EXEC", "1")
    assert not cli_server.forkable("ddpkit", env)
