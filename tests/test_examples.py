"""Each script in examples/ runs under `ddpkit run --nproc 2` on CPU (real gloo processes,
tiny generated data, 1 epoch), exits 0, and prints its results once, not once per rank."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> (its flags for a quick run, the line that must appear exactly once)
RUNS = {
    "toy_ddp.py": ([], "train accuracy 1.0"),
    "dataparallel_randn.py": (["--epochs", "1", "--size", "16"], "finished: 1 epochs on 2 process(es)"),
    "d2l_resnet18_fashion_mnist.py": (["--epochs", "1", "--size", "32", "--batch-size", "16"], "sec/epoch on 2 x cpu"),
    "cifar10_augment.py": (["--epochs", "1", "--size", "64", "--batch-size", "32"], "done: cnn on 64 images"),
    "lenet_mnist.py": (
        ["--epochs", "1", "--size", "128", "--batch-size", "32", "--log-every", "2"],
        "Finished Training",
    ),
    "own_loop_text.py": (["--epochs", "2"], "done: "),  # its own test below: a stop and a resume
}


def test_every_example_is_tested():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(RUNS)


def run_example(name: str, *flags: str) -> str:
    proc = run_cli("run", "--nproc", "2", str(EXAMPLES / name), "--synthetic", *flags, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(RUNS) - {"toy_ddp.py", "own_loop_text.py"}))  # those two: below
def test_example_runs_on_two_processes(name):
    flags, final = RUNS[name]
    out = run_example(name, *flags)
    assert out.count(final) == 1, out[-3000:]
    assert "[rank1]" not in out  # rank 1 prints nothing: every line comes from rank 0


def test_toy_example_reaches_accuracy_one_printed_once():
    out = run_example("toy_ddp.py")
    assert out.count("train accuracy 1.0\n") == 1 and out.count("test accuracy 1.0\n") == 1, out[-3000:]
    assert out.count("epoch 3/3") == 1


@pytest.mark.slow
def test_own_loop_text_example_stopped_and_resumed_ends_as_the_straight_run(tmp_path):
    # Two processes, lines of varying length, token-weighted updates, exactly-once gathered
    # test lines, rt.log: once straight, once stopped after epoch 1 and resumed from its state.
    flags, final = RUNS["own_loop_text.py"]
    straight = run_example("own_loop_text.py", *flags, "--out", str(tmp_path / "a"))
    run_example("own_loop_text.py", *flags, "--stop-after", "1", "--out", str(tmp_path / "b"))
    resumed = run_example("own_loop_text.py", *flags, "--resume", "--out", str(tmp_path / "b"))
    done = [line for line in straight.splitlines() if final in line]
    assert len(done) == 1 and "60 test lines" in done[0], straight[-3000:]
    assert done == [line for line in resumed.splitlines() if final in line]  # the loss to the last bit
    assert "[rank1]" not in straight + resumed
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]  # the resumed log kept the first attempt's record
