"""The runs the trainer's tests share, each made once for the whole folder: `straight`, the
uninterrupted 2-process `ddpkit train --epochs 2` run that the invariance and resume tests compare
with (the session's `two_process_run`, tests/conftest.py); `one_process`, the same on one process;
`three_processes`, the same on 3 processes with micro-batches; `stopped(step)`, that run stopped
at a step; and `three_checkpoints`, a finished one-process run
with several checkpoints (the session's `one_epoch_run`). Tests that continue or damage a run work
on their own copy (helpers.copied). Each is made once per run of the suite, however many workers
run its files (tests/parallel.py)."""

from __future__ import annotations

import pytest

from tests.parallel import made_once
from tests.trainer.helpers import THREE, finished, train


@pytest.fixture(scope="package")
def straight(two_process_run):
    """The uninterrupted 2-process run the other runs are compared with."""
    return finished(*two_process_run)


@pytest.fixture(scope="package")
def one_process(tmp_path_factory, pytestconfig):
    """`straight`'s run on one process, with --max-steps 46 (= its whole 2 epochs): compared
    with `straight` (test_invariance) and the run that --max-steps on an epoch's end completes
    (test_loop)."""

    def make():
        return train(tmp_path_factory.mktemp("one_process") / "out", "--nproc", "1", "--max-steps", "46")

    return made_once(pytestconfig, "one_process", make)


@pytest.fixture(scope="package")
def three_processes(tmp_path_factory, pytestconfig):
    """`straight`'s run on 3 processes (`THREE`): compared with `straight` and with itself
    stopped and resumed (test_invariance)."""
    return made_once(
        pytestconfig, "three_processes", lambda: train(tmp_path_factory.mktemp("three_processes") / "out", *THREE)
    )


@pytest.fixture(scope="package")
def stopped(tmp_path_factory, pytestconfig):
    """`stopped(step)`: the out directory of `straight`'s run stopped by --max-steps STEP, with a
    checkpoint every 10 steps and the newest 3 kept (made once per step), and its results."""
    made: dict[int, tuple] = {}

    def make(step: int):
        def make():
            out = tmp_path_factory.mktemp(f"stopped-{step}") / "out"
            flags = ("--nproc", "2", "--max-steps", str(step), "--checkpoint-every", "10", "--keep-checkpoints", "3")
            return out, train(out, *flags)

        if step not in made:
            made[step] = made_once(pytestconfig, f"stopped-{step}", make)
        return made[step]

    return make


@pytest.fixture(scope="package")
def three_checkpoints(one_epoch_run):
    """A finished one-epoch run on one process that checkpointed every 5 steps and kept the
    newest 3: steps 15, 20 and 23 (the epoch's end). The session's `one_epoch_run`
    (tests/conftest.py)."""
    return one_epoch_run[0]
