"""`plan`: settings checked once, before anything starts, with errors naming the flag; the
dataset shape known without its files; the learning rate scaled and warmed up as asked."""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit import data
from ddpkit.errors import UsageError
from ddpkit.trainer import TrainConfig, resolve
from tests.trainer.helpers import train


@pytest.mark.unit
@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("epochs", 0, "--epochs"),
        ("batch_size", -1, "--batch-size"),
        ("data", "imagenet", "--data"),
        ("model", "gpt", "--model"),
        ("nproc", "0", "--nproc"),
        ("synthetic_shape", "3,x", "--synthetic-shape"),
    ],
)
def test_config_errors_name_the_flag(field, value, flag):
    with pytest.raises(UsageError, match=flag):
        resolve(TrainConfig(**{field: value}))


@pytest.mark.unit
def test_resume_auto_needs_out():
    with pytest.raises(UsageError, match="--resume auto needs --out"):
        resolve(TrainConfig(resume="auto"))


@pytest.mark.unit
def test_config_knows_shapes_without_files():
    resolve(TrainConfig(data="cifar10", model="lenet", augment="crop-flip"))
    resolve(TrainConfig(data="mnist", model="lenet"))
    with pytest.raises(UsageError, match="--augment"):
        resolve(TrainConfig(data="toy", model="mlp", augment="flip"))
    toy = data.load("toy")
    assert toy.train.tensors[0].dtype == torch.float32 and toy.train.tensors[1].tolist() == [0, 0, 0, 1, 1]
    assert data.shape_of("toy") == ((2,), 2) and len(toy.test) == 2


@pytest.mark.cli
def test_lr_scaling_and_warmup_recorded(tmp_path):
    out = tmp_path / "out"
    r = train(
        out,
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--batch-size",
        "128",
        "--lr-scaling",
        "linear",
        "--reference-batch-size",
        "64",
        "--lr",
        "0.05",
        "--warmup-epochs",
        "0.5",
        "--log-every",
        "1",
    )
    assert r["results"]["peak_lr"] == pytest.approx(0.1)
    lrs = [
        json.loads(line)["lr"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "step"
    ]
    # 12 steps, warmup over the first 6: from the reference LR (0.05) up to 0.1, then cosine down
    assert lrs[0] == pytest.approx(0.05 + 0.05 / 6)
    assert max(lrs) == pytest.approx(0.1)
    assert lrs.index(max(lrs)) == 5 and lrs[-1] < lrs[6]
