"""`loop`: out of memory names the batch and what to try; a non-finite loss is skipped on every
rank when asked, and otherwise stops the run naming step and rank; `--max-steps` on an epoch's
end completes that epoch; the final test results are the final weights' (the last epoch's
evaluation when no step came after it, a new one otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddpkit.trainer import TrainConfig, resolve
from tests.conftest import clean_env
from tests.trainer.helpers import train


@pytest.mark.unit
def test_out_of_memory_names_the_batch_and_what_to_try(tmp_path):
    import ddpkit
    from ddpkit.trainer.loop import Loop
    from ddpkit.trainer.outputs import Outputs

    cfg = TrainConfig(model="mlp", epochs=1, batch_size=32, device="cpu", out=str(tmp_path))
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        loop = Loop(rt, resolve(cfg))

        def exhausted(*args, **kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        loop.model.forward = exhausted
        with Outputs(cfg, rt.is_main) as out, pytest.raises(torch.cuda.OutOfMemoryError) as info:
            loop.train_epoch(out)
    message = str(info.value)
    assert "rank 0" in message and "32 samples per forward" in message and "global batch 32" in message
    assert "--micro-batch-size 16" in message


@pytest.mark.unit
def test_on_nonfinite_skip_drops_that_step_on_every_rank(tmp_path):
    import ddpkit
    from ddpkit.trainer.loop import Loop
    from ddpkit.trainer.outputs import Outputs

    cfg = TrainConfig(model="mlp", epochs=1, batch_size=64, device="cpu", out=str(tmp_path), on_nonfinite="skip")
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        loop = Loop(rt, resolve(cfg))
        real, calls = loop.model.forward, []

        def poisoned(x):
            calls.append(1)
            out = real(x)
            return out * float("nan") if len(calls) == 3 else out  # the 3rd step's loss is NaN

        loop.model.forward = poisoned
        with Outputs(cfg, rt.is_main) as out:
            assert loop.train_epoch(out)
            loop.check_finite(out)  # would raise on NaN weights: the bad step never reached them
    assert loop.run.skipped == 1 and loop.run.step == 23
    skips = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "skip"
    ]
    assert [r["step"] for r in skips] == [3]


@pytest.mark.distributed
def test_finiteness_is_decided_alike_on_every_rank_from_every_ranks_facts(tmp_path):
    import ddpkit
    from tests.trainer.workers_finite import check_finite_facts

    said = ddpkit.launch(check_finite_facts, str(tmp_path), nproc=2)
    assert said[0] == said[1]  # every rank stops alike
    fine, loss, weights = said[0]
    assert fine == ""
    assert "non-finite training loss at step 7 on rank 1 " in loss
    assert "the weights hold NaN or inf after step 0" in weights


@pytest.mark.cli
def test_non_finite_loss_stops_the_run_naming_step_and_rank(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "--lr",
            "1e6",
            "--epochs",
            "2",
            "--nproc",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite training loss at step" in last and "on rank" in last and "--lr" in last
    assert not list((out / "checkpoints").iterdir())  # nothing trained on NaN was saved
    assert not (out / "model.pt").exists()


@pytest.mark.cli
def test_max_steps_on_an_epoch_end_completes_that_epoch(one_process):
    r = one_process  # --epochs 2 --nproc 1 --max-steps 46: the whole 2-epoch run (tests/trainer/conftest.py)
    assert r["results"]["epochs_completed"] == 2 and not r["results"]["stopped_early"]
    assert r["results"]["final_train_loss"] is not None


@pytest.mark.cli
@pytest.mark.parametrize("stop_at", [23, 30], ids=["epoch-end", "mid-epoch"])
def test_the_final_test_results_are_those_of_the_final_weights(stopped, stop_at):
    import torch.nn.functional as F

    from ddpkit import data, models

    out, run = stopped(stop_at)  # --nproc 2 --max-steps STOP_AT (tests/trainer/conftest.py)
    model = models.build("cnn", (1, 8, 8), 10)
    model.load_state_dict(run["weights"])
    model.eval()
    x, y = data.digits().test.tensors
    with torch.no_grad():
        logits = model(x)
    r = run["results"]
    assert r["test_accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item(), abs=1e-12)
    assert r["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    if stop_at == 23:  # epoch 1 ended at step 23 and nothing trained after: the same numbers
        assert last["type"] == "epoch" and last["step"] == 23
        assert (r["test_accuracy"], r["test_loss"]) == (last["test_accuracy"], last["test_loss"])


@pytest.mark.cli
@pytest.mark.slow
def test_max_grad_norm_clips_each_step_alike_under_fsdp_on_2_and_on_1_and_must_match_to_resume(tmp_path):
    from tests.conftest import run_cli
    from tests.trainer.helpers import ATOL_46_STEPS, max_diff

    steps = ("--epochs", "1", "--max-steps", "6")
    one = train(tmp_path / "one", *steps, "--nproc", "1", "--max-grad-norm", "0.2")
    # The other fsdp flags change where shards live and when they are gathered, not the result.
    fsdp_flags = ("--strategy", "fsdp", "--fsdp-cpu-offload", "--nofsdp-reshard-after-forward")
    fsdp = train(tmp_path / "fsdp", *steps, "--nproc", "2", *fsdp_flags, "--max-grad-norm", "0.2")
    unclipped = train(tmp_path / "unclipped", *steps, "--nproc", "1")
    assert one["results"]["max_grad_norm"] == fsdp["results"]["max_grad_norm"] == 0.2
    assert "max_grad_norm: 0.2" in (tmp_path / "fsdp" / "config.yaml").read_text()
    assert max_diff(one["weights"], unclipped["weights"]) > 1e-3  # the bound cut the steps
    assert fsdp["results"]["strategy"] == "fsdp"
    assert max_diff(fsdp["weights"], one["weights"]) < ATOL_46_STEPS  # the norm over all shards
    # It changes every update: a run cannot continue without it.
    proc = run_cli("train", "--device", "cpu", "--out", str(tmp_path / "one"), "--resume", "auto")
    assert proc.returncode == 2
    assert "was trained with --max-grad-norm 0.2; this run has no --max-grad-norm" in proc.stderr
