"""`ddpkit train --early-stop-patience` and `--ema`: a run that stops early says so everywhere,
its EMA weights are evaluated every epoch and saved as model_ema.pt (loadable into the bare
model), and a run stopped and resumed with both ends bit-identical, the early-stopping count
carried in the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit import models
from ddpkit.errors import IncompatibleCheckpoint
from ddpkit.trainer import TrainConfig
from ddpkit.trainer.resume import check_resumable, newest_checkpoint
from tests.trainer.helpers import train

pytestmark = [pytest.mark.cli, pytest.mark.slow]

# --early-stop-min-delta 10: no epoch improves the test loss by 10, so the run stops after
# epoch 1 (the first value) + 1 without improvement = epoch 2 of 3, whatever the losses are.
# The mlp: a third of the cnn's time here, and what is tested does not depend on the model.
FLAGS = ("--model", "mlp", "--nproc", "1", "--epochs", "3", "--ema", "0.9")
FLAGS += ("--early-stop-patience", "1", "--early-stop-min-delta", "10")
STEPS_PER_EPOCH = 23  # digits: 1438 samples in global batches of 64


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("early_ema") / "out"
    return out, train(out, *FLAGS)


def test_early_stopping_ends_the_run_and_every_output_says_so(straight):
    out, run = straight
    r = run["results"]
    assert r["early_stopped_at_epoch"] == 2 and r["stopped_early"] and r["epochs_completed"] == 2
    assert r["steps"] == 2 * STEPS_PER_EPOCH
    assert "early stop after epoch 2: the test loss has not improved by more than 10 for 1 epoch (best" in run["stdout"]
    assert "early stop     after epoch 2" in run["stdout"]  # the summary's row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [rec for rec in records if rec["type"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert all(0 < e["test_accuracy_ema"] <= 1 and e["test_loss_ema"] > 0 for e in epochs)
    assert "test_loss_ema,test_accuracy_ema" in (out / "metrics.csv").read_text().splitlines()[0]


def test_the_ema_weights_are_evaluated_and_saved_beside_the_raw_ones(straight):
    out, run = straight
    r, weights = run["results"], run["weights"]
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert r["ema"] == 0.9 and r["test_loss_ema"] == last["test_loss_ema"]  # no step after epoch 2
    assert r["test_loss_ema"] != r["test_loss"]
    ema = torch.load(out / "model_ema.pt", weights_only=True)
    assert list(ema) == list(weights) and not any(k.startswith(("module.", "_orig_mod.")) for k in ema)
    assert all(not torch.equal(ema[k], weights[k]) for k in ema)  # averaged (the mlp has no buffers)
    models.build("mlp", (1, 8, 8), 10).load_state_dict(ema)  # strict: every key, every shape
    assert "EMA weights    test accuracy" in run["stdout"]


def test_a_run_stopped_and_resumed_with_both_ends_bit_identical(straight, tmp_path):
    out_straight, run = straight
    out = tmp_path / "out"
    train(out, *FLAGS, "--max-steps", str(STEPS_PER_EPOCH + 4))  # inside epoch 2, epoch 1's loss the best
    resumed = train(out, *FLAGS, "--resume", "auto")
    # The state came back: counting afresh, epoch 2 would be the first value and the run would go on.
    assert resumed["results"]["early_stopped_at_epoch"] == 2
    assert all(torch.equal(resumed["weights"][k], run["weights"][k]) for k in run["weights"])
    ema, ema_straight = (torch.load(d / "model_ema.pt", weights_only=True) for d in (out, out_straight))
    assert all(torch.equal(ema[k], ema_straight[k]) for k in ema_straight)
    assert resumed["results"]["test_loss_ema"] == run["results"]["test_loss_ema"]
    with pytest.raises(IncompatibleCheckpoint, match="was trained with --ema 0.9; this run has --ema 0.5"):
        check_resumable(str(newest_checkpoint(str(out))), TrainConfig(model="mlp", epochs=5, ema=0.5), (1, 8, 8), 10)
