"""configs/*.yaml load and validate as TrainConfig; `--model package.module:function` builds a
user's own network, in one process and in the workers of `ddpkit train --nproc 2`."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from torch import nn

from ddpkit import models
from ddpkit.trainer import TrainConfig, resolve
from ddpkit.trainer.config import load_config_file
from ddpkit.data import DATASETS
from ddpkit.errors import UsageError
from tests.conftest import run_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"d2l-resnet18-fashion-mnist.yaml", "d2l-resnet18-fashion-mnist-2dev.yaml", "cifar10-augment.yaml",
            "toy-ddp.yaml", "lenet-mnist.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_validates(path):
    values = load_config_file(str(path))
    if values.get("data") not in DATASETS:
        pytest.skip(f"dataset {values.get('data')!r} is not in ddpkit.data.DATASETS yet")
    cfg = resolve(TrainConfig(**values)).cfg
    assert cfg.data == values["data"]
    header = path.read_text().split("\n\n")[0]  # the comment header says how to run the file
    assert f"ddpkit train --config configs/{path.name}" in header


def test_d2l_configs_are_the_tutorials_two_calls():
    one = TrainConfig(**load_config_file(str(ROOT / "configs/d2l-resnet18-fashion-mnist.yaml")))
    two = TrainConfig(**load_config_file(str(ROOT / "configs/d2l-resnet18-fashion-mnist-2dev.yaml")))
    assert (one.batch_size, one.lr, one.nproc) == (256, 0.1, "1")
    assert (two.batch_size, two.lr, two.nproc) == (512, 0.2, "2")
    assert one.momentum == two.momentum == 0.0 and one.weight_decay == 0.0


def test_momentum_reaches_the_optimizer():
    from ddpkit.optim import build_optimizer

    params = [nn.Parameter(torch.zeros(2))]
    plain = build_optimizer("sgd", params, 0.1, momentum=TrainConfig(momentum=0.0).momentum).param_groups[0]
    assert plain["momentum"] == 0.0 and plain["nesterov"] is False
    default = build_optimizer("sgd", params, 0.1, momentum=TrainConfig().momentum).param_groups[0]
    assert default["momentum"] == 0.9 and default["nesterov"] is True
    with pytest.raises(UsageError, match="--momentum"):
        resolve(TrainConfig(momentum=1.5))


def test_toy_config_trains_to_accuracy_one(tmp_path):
    if "toy" not in DATASETS:
        pytest.skip("dataset 'toy' is not in ddpkit.data.DATASETS yet")
    proc = run_cli("train", "--config", str(ROOT / "configs/toy-ddp.yaml"), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run/results.json").read_text())["test_accuracy"] == 1.0


# -- --model package.module:function -----------------------------------------------------------

USER_MODELS = """
import math
import os

from torch import nn

def tiny(in_shape, num_classes):
    log = os.environ.get("DDPKIT_TEST_BUILD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {tuple(in_shape)} {num_classes}\\n")
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), num_classes))

def not_a_module(in_shape, num_classes):
    return "a string"

def fails_when_called(in_shape, num_classes):
    raise RuntimeError("only at build time")

VALUE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `user_models_<n>` in a fresh directory that is the current directory."""
    name = f"user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_build_user_model_from_current_directory(user_module):
    before = list(sys.path)
    model = models.build(f"{user_module}:tiny", (1, 8, 8), 10)
    assert isinstance(model, nn.Module) and model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert sys.path == before  # the current directory was on sys.path only while importing
    models.check(f"{user_module}:tiny", (1, 8, 8))
    resolve(TrainConfig(model=f"{user_module}:tiny", data="synthetic", synthetic_shape="1,8,8"))


@pytest.mark.parametrize("suffix, message", [
    (":not_a_module", "must return a torch.nn.Module, got str"),
    (":missing", "has no attribute 'missing'"),
    (":VALUE", "is not callable"),
    (":", "expected package.module:function"),
])
def test_bad_user_model_is_a_usage_error(user_module, suffix, message):
    with pytest.raises(ValueError, match=message):
        models.build(user_module + suffix, (1, 8, 8), 10)
    with pytest.raises(UsageError, match=f"^--model {user_module}{suffix}: .*{message}"):
        resolve(TrainConfig(model=user_module + suffix))


def test_unknown_module_and_unknown_name():
    with pytest.raises(UsageError, match="--model no_such_module_xyz:f: cannot import module 'no_such_module_xyz'"):
        resolve(TrainConfig(model="no_such_module_xyz:f"))
    with pytest.raises(UsageError, match="--model: unknown value 'resnet19'.*package.module:function"):
        resolve(TrainConfig(model="resnet19"))


def test_a_function_failing_on_meta_is_left_to_build(user_module):
    resolve(TrainConfig(model=f"{user_module}:fails_when_called"))  # the plan cannot tell
    with pytest.raises(RuntimeError, match="only at build time"):
        models.build(f"{user_module}:fails_when_called", (1, 8, 8), 10)


def test_user_model_in_ddpkit_train_nproc_2(tmp_path, user_module):
    log = tmp_path / "builds.txt"
    proc = run_cli("train", "--model", f"{user_module}:tiny", "--nproc", "2", "--epochs", "1", "--data", "synthetic",
                   "--synthetic-shape", "1,8,8", "--synthetic-size", "128", "--out", str(tmp_path / "run"),
                   cwd=str(tmp_path), env={"DDPKIT_TEST_BUILD_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{user_module}:tiny" in proc.stdout
    pids = {line.split()[0] for line in log.read_text().splitlines()}
    assert len(pids) >= 2  # built in each worker (and checked in the parent)
    assert json.loads((tmp_path / "run/results.json").read_text())["world_size"] == 2
