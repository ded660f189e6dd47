"""`workers`: CPU workers are forked (and behave as spawned ones would: their own signal handlers,
threads and random streams), name the failing rank and restart after a SIGKILL; spawn on
request, and always on CUDA. Forked workers inherit torch's compiler, imported by the
launching process while the rendezvous waits; a fork never sees such an import half done."""

from __future__ import annotations

import _thread
import builtins
import os
import signal
import sys
import threading
import time

import pytest
import torch

import ddpkit
from ddpkit.errors import Interrupted, WorkerFailed
from ddpkit.launcher import workers as launcher_workers
from ddpkit.launcher.workers import _interrupted, choose_start_method, preloaded, signals_never_dropped
from tests import workers
from tests.launcher.helpers import run_python

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def worker_facts() -> dict:
    import numpy as np

    a = torch.randn(512, 512)
    (a @ a).sum()  # a parallel region on the worker's threads: hangs if the parent's pool was inherited
    return {
        "forked": hasattr(sys, "_ddpkit_test_parent_marker"),  # set in the parent at run time
        "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
        "sigint_once": signal.getsignal(signal.SIGINT) is _interrupted,
        "threads": torch.get_num_threads(),
        "numpy": float(np.random.rand()),
        "parent": os.getppid(),
        "launch_dir": os.environ.get("DDPKIT_LAUNCH_DIR"),
    }


@pytest.mark.unit
def test_a_workers_first_sigint_is_a_keyboardinterrupt_and_a_second_ends_it_without_a_traceback():
    # Ctrl-C reaches the workers, then the agent stops them with the same signal: the second
    # one arrives while the first unwinds, here inside a generator's `finally` being closed.
    proc = run_python(
        """
        import os, signal, sys
        from ddpkit.launcher.workers import _interrupted
        signal.signal(signal.SIGINT, _interrupted)

        def batches():
            try:
                yield 1
            finally:
                print("closing", flush=True)
                os.kill(os.getpid(), signal.SIGINT)
                print("still here", flush=True)

        gen = batches()
        next(gen)
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            del gen
        print("survived", flush=True)
        """
    )
    assert proc.returncode == -signal.SIGINT, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["interrupted", "closing"]
    assert "Traceback" not in proc.stderr


def die_once_on_rank1() -> int:
    """Rank 1 of the first attempt dies without a word (like the OOM killer's victim)."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt


@pytest.fixture
def marked_parent(monkeypatch):
    monkeypatch.setattr(sys, "_ddpkit_test_parent_marker", True, raising=False)


@pytest.mark.distributed
@linux_only
@pytest.mark.timeout(120)
def test_cpu_workers_are_forked_yet_look_spawned(monkeypatch, marked_parent):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(1024, 1024)
        (a @ a).sum()  # this process now keeps a 2-thread OpenMP pool, which a fork must not inherit
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the workers run parallel regions of 2 threads too
        assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
        out = ddpkit.launch(worker_facts, nproc=2, device="cpu")
    finally:
        torch.set_num_threads(threads)
    for facts in out.values():
        assert facts["forked"] and facts["threads"] == 2
        # the agent's signal handlers are not inherited: a worker it stops dies at once
        assert facts["sigterm_default"] and facts["sigint_once"]
    assert out[0]["numpy"] != out[1]["numpy"]  # each rank's own NumPy stream, as when spawned


@pytest.mark.distributed
@linux_only
@pytest.mark.parametrize(
    "fn,args,nproc,rank,needle",
    [
        (workers.fail_on_rank, (1,), 3, 1, "ValueError: deliberate failure on rank 1"),
        (workers.stall_on_rank, (1, 3.0), 2, 1, "hung"),  # the stalled rank is stopped, and blamed
    ],
)
def test_forked_workers_name_the_failing_rank(fn, args, nproc, rank, needle):
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(fn, *args, nproc=nproc, device="cpu")
    assert info.value.rank == rank and needle in str(info.value)
    assert time.monotonic() - t0 < 25  # the agent's 30 s wait before SIGKILL never comes into play


@pytest.mark.distributed
@linux_only
def test_forked_workers_are_restarted_after_a_sigkill():
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    assert ddpkit.launch(die_once_on_rank1, nproc=2, device="cpu", max_restarts=1) == {0: 1, 1: 1}


@pytest.mark.unit
@linux_only
def test_a_python_thread_threading_does_not_know_of_means_spawn():
    # pytest-xdist's workers run such a thread (execnet starts it with _thread): forking there
    # once crashed the child while it collected garbage.
    assert choose_start_method("cpu") == "fork", f"threads left running by earlier tests: {threading.enumerate()}"
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def wait():
        started.set()
        release.wait()
        ended.set()

    _thread.start_new_thread(wait, ())
    assert started.wait(10)
    try:
        assert threading.active_count() == 1  # threading does not see it
        assert choose_start_method("cpu") == "spawn"
    finally:
        release.set()
    assert ended.wait(10)
    deadline = time.monotonic() + 10
    while len(sys._current_frames()) > 1 and time.monotonic() < deadline:  # its state is gone a moment later
        time.sleep(0.01)
    assert choose_start_method("cpu") == "fork"


@pytest.mark.distributed
def test_spawn_on_request(monkeypatch, marked_parent):
    monkeypatch.setenv("DDPKIT_START_METHOD", "spawn")
    assert choose_start_method("cpu") == "spawn"
    out = ddpkit.launch(worker_facts, nproc=2, device="cpu")
    assert not any(facts["forked"] for facts in out.values())
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=2, device="cpu")
    assert info.value.rank == 1


@pytest.mark.distributed
@linux_only
def test_a_fork_server_on_request_starts_each_jobs_workers_fresh_with_the_jobs_environment(monkeypatch, marked_parent):
    # forked from a fresh process that imported torch once for the job: each job's workers look
    # spawned, with that job's thread count and records folder (a server kept from the first
    # job would hand the second job's workers the first's)
    monkeypatch.setenv("DDPKIT_START_METHOD", "forkserver")
    assert choose_start_method("cpu") == "forkserver"
    jobs = []
    for threads in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        jobs.append(ddpkit.launch(worker_facts, nproc=2, device="cpu"))
    for threads, out in zip((1, 2), jobs):
        assert not any(facts["forked"] for facts in out.values())  # not this process's state
        assert all(facts["sigterm_default"] and facts["sigint_once"] for facts in out.values())
        assert {facts["threads"] for facts in out.values()} == {threads}
        assert out[0]["numpy"] != out[1]["numpy"]
    for out in jobs:
        assert len({facts["parent"] for facts in out.values()} - {os.getpid()}) == 1  # the job's server
    assert jobs[0][0]["parent"] != jobs[1][0]["parent"]
    dirs = [{facts["launch_dir"] for facts in out.values()} for out in jobs]
    assert all(len(d) == 1 and None not in d for d in dirs) and dirs[0] != dirs[1]
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=2, device="cpu")
    assert info.value.rank == 1


@pytest.mark.unit
def test_cuda_workers_are_spawned():
    assert choose_start_method("cuda") == "spawn"


def slow_module(tmp_path, monkeypatch, name: str, seconds: float) -> str:
    """A module `name` that takes `seconds` to import and then sets DONE, not imported yet."""
    (tmp_path / f"{name}.py").write_text(f"import time\ntime.sleep({seconds})\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.mark.unit
@linux_only
def test_a_fork_waits_for_the_preload_and_a_failing_import_is_left_alone(tmp_path, monkeypatch):
    # A fork made at once inside the block must see the slow module whole.
    slow_module(tmp_path, monkeypatch, "slow_preload_mod", 0.4)
    with preloaded(["no_such_module_for_ddpkit", "slow_preload_mod"]):  # the first fails, quietly
        pid = os.fork()
        if pid == 0:
            mod = sys.modules.get("slow_preload_mod")
            os._exit(0 if mod is not None and getattr(mod, "DONE", False) else 3)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert "no_such_module_for_ddpkit" not in sys.modules
    assert not [t for t in threading.enumerate() if t.name == "ddpkit-preload"]  # joined by the block's end


@pytest.mark.unit
@linux_only
def test_an_interrupted_launch_does_not_wait_for_the_preload(tmp_path, monkeypatch):
    # A Ctrl-C landing in the main thread just as it takes importlib's global lock can leave the
    # lock held (CPython 3.11's _get_module_lock): the preload's import never ended, and an
    # interrupted `ddpkit train` hung at the block's end, joining it. An import that has not
    # ended stands for that one here.
    gate = threading.Event()
    monkeypatch.setattr(builtins, "_ddpkit_preload_gate", gate, raising=False)
    (tmp_path / "gated_preload_mod.py").write_text("import builtins\nbuiltins._ddpkit_preload_gate.wait(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gated_preload_mod", raising=False)
    monkeypatch.setattr(launcher_workers, "_preload", None)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), preloaded(["gated_preload_mod"]):
        raise KeyboardInterrupt
    waited = time.monotonic() - start
    thread = launcher_workers._preload
    gate.set()
    thread.join(30)
    assert waited < 5, waited
    assert thread.name == "ddpkit-preload"  # left for a later fork of this process to wait for


@pytest.mark.unit
@linux_only
def test_a_signal_while_a_fork_waits_for_the_preload_is_handled_after_the_fork(tmp_path, monkeypatch):
    # Ctrl-C or a scheduler's SIGTERM can come while a fork waits for the preload: the wait goes
    # on (a worker forked mid-import would hang on its lock), and the signal is not lost (an
    # exception raised in a fork hook would be): its handler runs once the fork is done.
    slow_module(tmp_path, monkeypatch, "slow_preload_mod2", 0.5)
    handled: list[float] = []
    previous = signal.signal(signal.SIGHUP, lambda *_: handled.append(time.monotonic()))
    try:
        with preloaded(["slow_preload_mod2"]):
            sender = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGHUP))
            sender.start()
            pid = os.fork()
            if pid == 0:
                mod = sys.modules.get("slow_preload_mod2")
                os._exit(0 if mod is not None and getattr(mod, "DONE", False) else 3)
            forked = time.monotonic()
            assert not handled  # held while the fork waited
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0  # the worker got the import whole
            deadline = time.monotonic() + 5
            while not handled and time.monotonic() < deadline:
                time.sleep(0.01)
        assert len(handled) == 1 and handled[0] >= forked  # delivered once, after the fork
    finally:
        sender.join()
        signal.signal(signal.SIGHUP, previous)


class _SignalRaised(Exception):
    def __init__(self, sigval: int):
        super().__init__(sigval)
        self.sigval = sigval


class _RaisesWhenCollected:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def __del__(self):
        raise self.exc


@pytest.mark.unit
@linux_only
def test_a_signals_exception_dropped_where_python_cannot_raise_is_sent_again(monkeypatch):
    # A handler's exception raised in a __del__ or a fork hook is dropped by Python; during a
    # launch its signal is sent again, and the handler runs again outside. Other exceptions
    # still reach the hook that was there before.
    handled: list[int] = []
    passed_on: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: passed_on.append(u.exc_value))
    previous = {
        sig: signal.signal(sig, lambda signum, _: handled.append(signum))
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
    }
    try:
        with signals_never_dropped(_SignalRaised):
            _RaisesWhenCollected(KeyboardInterrupt())  # Python's own SIGINT handler's
            _RaisesWhenCollected(_SignalRaised(signal.SIGHUP))  # the agent's
            _RaisesWhenCollected(Interrupted(signal.SIGTERM))  # the CLI's, before the agent starts
            _RaisesWhenCollected(ValueError("not a signal's"))
            deadline = time.monotonic() + 5
            while len(handled) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert sorted(handled) == sorted([signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
        assert [type(e) for e in passed_on] == [ValueError]
        _RaisesWhenCollected(_SignalRaised(signal.SIGHUP))  # after the launch: as before it
        assert [type(e) for e in passed_on] == [ValueError, _SignalRaised]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.fixture
def fork_window(monkeypatch):
    """The fork hooks' module state, clean before and after; SIGTERM recorded (the agent's
    handler's stand-in); a `set_handler` that raises as a signal's handler would, at the calls
    listed in `fails` (1 for the first call, ...). Yields (fails, the SIGTERMs handled)."""
    fails: list[int] = []
    calls: list[int] = []
    handled: list[int] = []

    def set_handler(sig, handler):
        calls.append(sig)
        if len(calls) in fails:  # as a pending signal's handler would, before this change is made
            raise _SignalRaised(signal.SIGTERM)
        return signal.signal(sig, handler)

    monkeypatch.setattr(launcher_workers, "set_handler", set_handler)
    previous = signal.signal(signal.SIGTERM, lambda signum, _: handled.append(signum))
    try:
        yield fails, handled
    finally:
        launcher_workers._saved.clear()
        launcher_workers._held.clear()
        signal.signal(signal.SIGTERM, previous)


def _handled_once(handled: list[int]) -> bool:
    deadline = time.monotonic() + 5
    while not handled and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # (and no second time)
    return handled == [signal.SIGTERM]


@pytest.mark.unit
@linux_only
def test_a_handler_raising_in_the_fork_hook_neither_skips_the_wait_nor_loses_its_signal(
    tmp_path, monkeypatch, fork_window
):
    # A signal noted just before the fork runs its handler where the hook swaps the handlers:
    # the fork must still wait for the preload, every handler be held through the fork and the
    # agent's again after it, and the signal be handled once, after the fork.
    fails, handled = fork_window
    fails.append(2)
    slow_module(tmp_path, monkeypatch, "slow_preload_mod3", 0.3)
    before = {sig: signal.getsignal(sig) for sig in launcher_workers._AGENT_SIGNALS}
    with preloaded(["slow_preload_mod3"]):
        launcher_workers._join_for_fork()
        assert getattr(sys.modules.get("slow_preload_mod3"), "DONE", False)  # waited all the same
        assert all(signal.getsignal(sig) is launcher_workers._hold for sig in before)  # the failed swap made again
        assert not handled
        launcher_workers._deliver_held()  # as after the fork
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert _handled_once(handled)


@pytest.mark.unit
@linux_only
def test_a_handler_raising_while_the_handlers_come_back_neither_keeps_a_hold_nor_loses_its_signal(fork_window):
    fails, handled = fork_window
    before = {sig: signal.getsignal(sig) for sig in launcher_workers._AGENT_SIGNALS}
    launcher_workers._join_for_fork()  # (no preload: the swap alone)
    fails.append(len(before) + 2)  # the second handler put back raises, once
    launcher_workers._deliver_held()
    assert {sig: signal.getsignal(sig) for sig in before} == before and not launcher_workers._saved
    assert _handled_once(handled)


@pytest.mark.unit
@linux_only
def test_only_a_launch_folder_whose_lock_is_free_and_settled_is_removed(tmp_path):
    import fcntl

    from ddpkit.launcher.elastic import HELD, LAUNCH_PREFIX, remove_abandoned

    def folder(name: str, age_s: float | None, prefix: str = LAUNCH_PREFIX):
        path = tmp_path / f"{prefix}{name}"
        (path / "attempt-0").mkdir(parents=True)
        if age_s is not None:
            (path / HELD).touch()
            os.utime(path / HELD, (time.time() - age_s,) * 2)
        return path

    killed, running, just_made = folder("killed", 600), folder("running", 600), folder("just-made", 1)
    older, other = folder("older-ddpkit", None), folder("x", 600, prefix="not-a-launch-")
    held = os.open(running / HELD, os.O_WRONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # (a lock of another open file: as a launch in another process)
    try:
        assert remove_abandoned(str(tmp_path)) == [str(killed)]
    finally:
        os.close(held)
    assert all(p.exists() for p in (running, just_made, older, other)) and not killed.exists()


@pytest.mark.distributed
@linux_only
def test_forked_workers_start_with_torchs_compiler_imported():
    # A fresh interpreter, where nothing imported torch._dynamo before the launch: forked
    # workers find it imported (by the launching process, while the rendezvous waited);
    # spawned ones start without it, as any new interpreter.
    program = """
        import os, sys, ddpkit

        def first_thing():
            return "torch._dynamo" in sys.modules

        print("before", "torch._dynamo" in sys.modules)
        print("forked", ddpkit.launch(first_thing, nproc=2, device="cpu"))
        os.environ["DDPKIT_START_METHOD"] = "spawn"
        print("spawned", ddpkit.launch(first_thing, nproc=2, device="cpu"))
    """
    proc = run_python(program)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "before False" in proc.stdout
    assert "forked {0: True, 1: True}" in proc.stdout
    assert "spawned {0: False, 1: False}" in proc.stdout


@pytest.mark.unit
def test_rendezvous_event_names_are_the_ones_torch_finds():
    # torch's rendezvous names an event after a caller it finds with inspect.stack(); the launch
    # reads the same name from the frame itself: the same name at every depth, and past the bottom,
    # and at the default depth from inside a recording method, as torch's rendezvous asks.
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from ddpkit.launcher.elastic import method_name

    def recorded_by(name_of) -> list[str]:
        class Handler:
            def _record(self):
                return name_of()

            def next_rendezvous(self):
                return self._record()

        def record(depth):
            return name_of(depth)

        def join_rendezvous(depth):
            return record(depth)

        return [Handler().next_rendezvous()] + [join_rendezvous(depth) for depth in (1, 2, 3, 10_000)]

    torch_names = recorded_by(rdzv.get_method_name)
    assert torch_names[:3] == ["next_rendezvous", "record", "join_rendezvous"]
    assert torch_names[-1] == "no_method_name"
    assert recorded_by(method_name) == torch_names


@pytest.mark.unit
def test_overlapping_launches_hand_torch_its_own_name_lookup_back():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from ddpkit.launcher.elastic import _rendezvous_events_named_by_frame, method_name

    torch_own = rdzv.get_method_name
    first, second = _rendezvous_events_named_by_frame(), _rendezvous_events_named_by_frame()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first launch ends while the second goes on
    assert rdzv.get_method_name is method_name
    second.__exit__(None, None, None)
    assert rdzv.get_method_name is torch_own


@pytest.mark.cli  # a real Python subprocess, forking its own children
def test_workers_left_by_an_interrupted_start_are_stopped_and_none_else():
    # A signal handled between two of the agent's forks raised inside torch's start_processes,
    # before the agent recorded the workers it started: its stop missed them, they waited for
    # their peers, and the launcher's exit waited for them (a test timed out so once).
    proc = run_python(
        """
        import multiprocessing, signal, time
        from ddpkit.launcher.elastic import stop_strays

        def waits():
            time.sleep(60)

        def deaf():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)

        print(stop_strays())  # none
        fork = multiprocessing.get_context("fork")
        children = [fork.Process(target=waits), fork.Process(target=deaf)]
        for child in children:
            child.start()
        time.sleep(0.5)  # (the deaf one has ignored SIGTERM by now)
        t0 = time.monotonic()
        stopped = stop_strays(grace_s=1.0)
        print(sorted(stopped) == sorted(c.pid for c in children), [c.exitcode for c in children])
        print(time.monotonic() - t0 < 10, multiprocessing.active_children())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["[]", f"True [{-signal.SIGTERM}, {-signal.SIGKILL}]", "True []"], proc.stdout
