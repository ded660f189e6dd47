"""`run_command`: each way a command ends, as its exit code and its last line (the commands
themselves run as subprocesses: test_main.py and the other files here)."""

from __future__ import annotations

import signal

import pytest

from ddpkit.cli import run_command
from ddpkit.errors import Interrupted, RunError, WorkerFailed

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("cannot join thread before it is started"),
        RunError("the disk is full"),  # one its message explains whole: no traceback
        WorkerFailed(1, "host", "failed: OSError: [Errno 28] No space left on device", pid=7),
    ],
    ids=["an error", "RunError", "WorkerFailed"],
)
def test_an_interrupt_whose_cleanup_fails_is_still_an_interrupt(sig, failure, capsys):
    # A signal's unwinding runs cleanups (a rendezvous' shutdown, a pool's stop, a checkpoint's
    # last write) that can fail for having been cut short: that failure is shown, and the exit
    # is still the signal's.
    def command(argv):
        try:
            raise Interrupted(sig)
        finally:
            raise failure

    assert run_command("ddpkit train", command, []) == 128 + sig
    err = capsys.readouterr().err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("ddpkit train: interrupted; the cleanup after it failed: ") and str(failure) in last
    assert ("Traceback" in err) == (type(failure) is RuntimeError)  # (the others' lines are the whole story)


def test_a_failure_after_an_interrupt_was_handled_is_a_failure(capsys):
    def handled(argv):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        raise RuntimeError("a bug of its own")

    def replaced(argv):  # caught and turned into an error of its own, on purpose
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("a bug of its own") from None

    for command in (handled, replaced):
        assert run_command("ddpkit train", command, []) == 1
        assert "failed: RuntimeError: a bug of its own" in capsys.readouterr().err
