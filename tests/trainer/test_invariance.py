"""`ddpkit train` end to end: the result does not depend on the number of processes, and a run
stopped at any step and resumed, on any number of processes, ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.trainer.helpers import ATOL_46_STEPS, THREE, copied, finished, max_diff, step_records, train

pytestmark = [pytest.mark.cli, pytest.mark.slow]


@pytest.mark.parametrize(
    "other", ["one_process", "three_processes"], ids=["1-process", "3-processes-uneven-accumulating"]
)
def test_same_result_on_any_number_of_processes(straight, request, other):
    # The runs of tests/trainer/conftest.py: --nproc 1 (with --max-steps 46, its end), and
    # --nproc 3 with micro-batches of 8 (uneven shares, each rank accumulating).
    other = request.getfixturevalue(other)
    assert other["results"]["test_accuracy"] == straight["results"]["test_accuracy"]
    assert other["results"]["steps"] == straight["results"]["steps"] == 46
    assert max_diff(other["weights"], straight["weights"]) < ATOL_46_STEPS


@pytest.mark.parametrize("stop_at", [23, 30], ids=["epoch-end", "mid-epoch"])
def test_stop_and_resume_is_bit_identical(straight, stopped, tmp_path, stop_at):
    run, first = stopped(stop_at)  # --nproc 2 --max-steps STOP_AT (tests/trainer/conftest.py)
    assert first["results"]["steps"] == stop_at and first["results"]["stopped_early"]
    out = copied(run, tmp_path)
    resumed = train(out, "--nproc", "2", "--resume", "auto")
    assert f"at step {stop_at}" in resumed["stdout"]
    assert resumed["results"]["resumed_from_step"] == stop_at
    assert max_diff(resumed["weights"], straight["weights"]) == 0.0
    assert resumed["results"]["final_train_loss"] == straight["results"]["final_train_loss"]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if r["type"] == "epoch"] == [1, 2]
    # Every log step's record, each written when a check came (by its own clock in each
    # attempt), holds the loss of its own step: the same as the uninterrupted run's.
    assert [r[0] for r in step_records(straight)] == [10, 20, 30, 40]
    assert step_records(resumed) == step_records(straight)
    assert [r["step"] for r in epochs] == sorted(r["step"] for r in epochs)  # written in order


def test_stop_and_resume_on_three_processes_is_bit_identical(three_processes, tmp_path):
    # On 3 ranks the all-reduce's sums depend on DDP's bucket layout, which DDP changes after a
    # run's first step: the resumed run's first step must run in the later layout too.
    out = tmp_path / "out"
    first = train(out, *THREE, "--max-steps", "30", "--checkpoint-every", "10")
    assert first["results"]["steps"] == 30
    resumed = train(out, *THREE, "--resume", "auto")
    assert resumed["results"]["resumed_from_step"] == 30
    assert max_diff(resumed["weights"], three_processes["weights"]) == 0.0
    assert resumed["results"]["final_train_loss"] == three_processes["results"]["final_train_loss"]
    assert step_records(resumed) == step_records(three_processes)


@pytest.mark.parametrize("nproc", ["1", "3"])
def test_resume_on_another_number_of_processes(straight, stopped, tmp_path, nproc):
    out = copied(stopped(30)[0], tmp_path)  # --nproc 2 --max-steps 30
    resumed = train(out, "--nproc", nproc, "--resume", "auto")
    assert resumed["results"]["world_size"] == int(nproc)
    assert resumed["results"]["steps"] == 46
    assert resumed["results"]["test_accuracy"] == straight["results"]["test_accuracy"]
    assert max_diff(resumed["weights"], straight["weights"]) < ATOL_46_STEPS


def test_fsdp_resumes_across_world_sizes_and_strategies(straight, fsdp_two_process_run, tmp_path):
    fsdp = finished(*fsdp_two_process_run)  # uninterrupted: --nproc 2 --strategy fsdp (tests/conftest.py)
    assert max_diff(fsdp["weights"], straight["weights"]) < ATOL_46_STEPS
    assert fsdp["results"]["test_accuracy"] == straight["results"]["test_accuracy"]
    # fsdp on 2 -> fsdp on 3 (uneven shards) -> one process (ddp) -> fsdp on 2, each resumed mid-epoch
    out = tmp_path / "chain"
    train(out, "--nproc", "2", "--strategy", "fsdp", "--max-steps", "12", "--checkpoint-every", "6")
    # on the same number of processes, a resumed fsdp run is bit-identical to the uninterrupted one
    same = shutil.copytree(out, tmp_path / "same")  # stopped mid-epoch at 12, before the damage below
    resumed = train(same, "--nproc", "2", "--strategy", "fsdp", "--resume", "auto")
    assert "step-00000012 at step 12" in resumed["stdout"]
    assert max_diff(resumed["weights"], fsdp["weights"]) == 0.0
    assert resumed["results"]["final_train_loss"] == fsdp["results"]["final_train_loss"]
    sharded = out / "checkpoints" / "step-00000012"
    assert sorted(p.name for p in sharded.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "checksums.json",
        "state.pt",
    ]
    shard = sharded / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # a damaged copy: never picked, the older one is
    three = train(out, "--nproc", "3", "--strategy", "fsdp", "--max-steps", "24", "--resume", "auto")
    assert "skipped" in three["stderr"] and "step-00000012: truncated (__1_0.distcp holds" in three["stderr"]
    assert "step-00000006 at step 6" in three["stdout"]
    assert (out / "checkpoints" / "step-00000024" / "__2_0.distcp").is_file()
    one = train(out, "--nproc", "1", "--max-steps", "34", "--resume", "auto")
    assert "resumed from" in one["stdout"] and "step-00000024 at step 24" in one["stdout"]
    assert (out / "checkpoints" / "step-00000034.pt").is_file()  # ddp on one process writes one file
    last = train(out, "--nproc", "2", "--strategy", "fsdp", "--resume", "auto")
    assert last["results"]["steps"] == 46
    assert max_diff(last["weights"], straight["weights"]) < ATOL_46_STEPS
