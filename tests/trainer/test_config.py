"""`config`: configs/*.yaml load and validate as TrainConfig and name their own command, and a
model's recipe defaults yield to the YAML file and the flags."""

from __future__ import annotations

import json
import pathlib

import pytest

from ddpkit.data import DATASETS
from ddpkit.errors import UsageError
from ddpkit.trainer import TrainConfig, resolve
from ddpkit.trainer.config import load_config_file
from tests.conftest import run_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.unit
def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {
        "d2l-resnet18-fashion-mnist.yaml",
        "d2l-resnet18-fashion-mnist-2dev.yaml",
        "cifar10-augment.yaml",
        "toy-ddp.yaml",
        "lenet-mnist.yaml",
    } <= names


@pytest.mark.unit
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_validates(path):
    values = load_config_file(str(path))
    if values.get("data") not in DATASETS:
        pytest.skip(f"dataset {values.get('data')!r} is not in ddpkit.data.DATASETS yet")
    cfg = resolve(TrainConfig(**values)).cfg
    assert cfg.data == values["data"]
    header = path.read_text().split("\n\n")[0]  # the comment header says how to run the file
    assert f"ddpkit train --config configs/{path.name}" in header


@pytest.mark.unit
def test_d2l_configs_are_the_tutorials_two_calls():
    one = TrainConfig(**load_config_file(str(ROOT / "configs/d2l-resnet18-fashion-mnist.yaml")))
    two = TrainConfig(**load_config_file(str(ROOT / "configs/d2l-resnet18-fashion-mnist-2dev.yaml")))
    assert (one.batch_size, one.lr, one.nproc) == (256, 0.1, "1")
    assert (two.batch_size, two.lr, two.nproc) == (512, 0.2, "2")
    assert one.momentum == two.momentum == 0.0 and one.weight_decay == 0.0


@pytest.mark.cli
def test_toy_config_trains_to_accuracy_one(tmp_path):
    if "toy" not in DATASETS:
        pytest.skip("dataset 'toy' is not in ddpkit.data.DATASETS yet")
    proc = run_cli("train", "--config", str(ROOT / "configs/toy-ddp.yaml"), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run/results.json").read_text())["test_accuracy"] == 1.0


@pytest.mark.unit
def test_model_recipe_defaults_yield_to_yaml_and_flags(tmp_path):
    # The layering is settled before anything runs: `ddpkit train` parses its command line
    # (cli.train.parse) and resolves the plan, whose cfg rank 0 writes to config.yaml as it is
    # (real runs' config.yaml: cli/test_train.py, with a file under flags, and
    # bench/test_fast_cifar.py, with this recipe).
    from ddpkit.cli.train import parse

    base = (
        "--model",
        "fast-cifar",
        "--data",
        "synthetic",
        "--synthetic-size",
        "48",
        "--synthetic-shape",
        "3,16,16",
        "--epochs",
        "1",
        "--eval-batch-size",
        "64",
        "--device",
        "cpu",
    )
    cfg = resolve(parse(base)).cfg.to_dict()
    assert (cfg["batch_size"], cfg["label_smoothing"], cfg["augment"]) == (1024, 0.2, "crop-flip")
    assert cfg["precision"] == "fp32" and not cfg["channels_last"]  # the GPU part of the recipe: not on CPU
    conf = tmp_path / "c.yaml"
    conf.write_text("label_smoothing: 0.1\nbatch_size: 32\n")
    cfg = resolve(parse([*base, "--config", str(conf), "--batch-size", "16"])).cfg.to_dict()
    assert (cfg["label_smoothing"], cfg["batch_size"], cfg["lr"]) == (0.1, 16, 0.4)


@pytest.mark.unit
def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    # nine lines that stand for 9**9 strings: before, 98 s and a MemoryError
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nepochs: *a8\n")
    with pytest.raises(
        UsageError, match=r"bomb.yaml: more than 10,000 values once its aliases \(\*name\) are expanded"
    ):
        load_config_file(str(path))
    path.write_text("common: &lr 0.05\nlr: *lr\n")  # an alias of a few values is fine, and read as written
    with pytest.raises(UsageError, match=r"unknown option 'common'"):
        load_config_file(str(path))
