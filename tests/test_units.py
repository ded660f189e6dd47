"""Small pieces in one process: environment detection, samplers, checkpoints, config."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from ddpkit import data, dist, models
from ddpkit.checkpoint import load_file, save_file
from ddpkit.config import TrainConfig
from ddpkit.errors import UsageError
from ddpkit.launcher import auto_nproc, parse_nproc
from ddpkit.strategy import unwrap


@pytest.mark.parametrize("nodelist,host", [("gpu[07-09,12],cpu1", "gpu07"), ("node1", "node1"),
                                           ("a[3]", "a3"), ("n[001-004]", "n001"), ("x1,x2", "x1")])
def test_first_slurm_host(nodelist, host):
    assert dist.first_slurm_host(nodelist) == host


def test_detect_env_from_slurm(monkeypatch):
    for k, v in {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
                 "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[3-4]"}.items():
        monkeypatch.setenv(k, v)
    env = dist.detect_env()
    assert (env.source, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("slurm", 5, 1, 8, 4)
    assert env.master_addr == "gpu3" and env.master_port == 15000 + 4242


def test_detect_env_torchrun_wins_over_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for k, v in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    env = dist.detect_env()
    assert (env.source, env.rank, env.world_size) == ("torchrun", 2, 3)


def test_plain_process_is_single():
    env = dist.detect_env()
    assert env.source == "single" and not env.is_distributed


@pytest.mark.parametrize("n,world", [(10, 3), (1, 4), (7, 7), (359, 2)])
def test_shard_sampler_partitions_exactly(n, world):
    seen = [i for r in range(world) for i in data.ShardSampler(n, world, r)]
    assert sorted(seen) == list(range(n))
    assert sum(len(data.ShardSampler(n, world, r)) for r in range(world)) == n


def test_per_rank_batch_rules():
    assert data.per_rank_batch(12, 3) == 4
    with pytest.raises(ValueError, match="smaller than the 4 processes"):
        data.per_rank_batch(3, 4)
    with pytest.raises(ValueError, match="such as 62 or 64"):
        data.per_rank_batch(63, 2)


def test_digits_split_is_fixed_and_matches_scikit_learn():
    from sklearn.datasets import load_digits

    splits = data.digits()
    assert (len(splits.train), len(splits.test)) == (1438, 359)
    reference = load_digits()
    x_train, y_train = splits.train.tensors
    assert torch.equal(torch.bincount(torch.cat([y_train, splits.test.tensors[1]]), minlength=10),
                       torch.bincount(torch.from_numpy(reference.target), minlength=10))
    again = data.digits()  # independent of any seed in force
    torch.manual_seed(123)
    assert torch.equal(again.test.tensors[0], data.digits().test.tensors[0])


@pytest.mark.parametrize("name", list(models.MODELS))
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (1, 28, 28)])
def test_models_build_and_run(name, shape):
    net = models.build(name, shape, 10)
    assert net(torch.randn(2, *shape)).shape == (2, 10)


def test_unwrap_strips_wrappers():
    bare = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(bare)) is bare
    compiled = torch.compile(bare)
    assert unwrap(compiled) is bare
    assert not any(k.startswith("_orig_mod.") for k in unwrap(compiled).state_dict())


def test_nproc_parsing():
    assert parse_nproc("3", "cpu") == 3 and parse_nproc(2, "cpu") == 2
    assert parse_nproc("auto", "cpu") == auto_nproc("cpu") >= 1
    for bad in ("0", "-1", "x"):
        with pytest.raises(UsageError):
            parse_nproc(bad, "cpu")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddpkit-should-not-exist",))


def test_checkpoint_files_are_atomic_and_safe(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"w": torch.ones(3), "step": 4})
    assert load_file(path)["step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind
    (tmp_path / "bad.pt").write_bytes(path.read_bytes()[:40])
    with pytest.raises(UsageError, match="bad.pt"):
        load_file(tmp_path / "bad.pt")
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(_Payload(), f)
    if os.path.exists("/tmp/ddpkit-should-not-exist"):
        os.unlink("/tmp/ddpkit-should-not-exist")
    with pytest.raises(UsageError, match="evil.pt"):
        load_file(tmp_path / "evil.pt")
    assert not os.path.exists("/tmp/ddpkit-should-not-exist")
    with pytest.raises(UsageError, match="no such file"):
        load_file(tmp_path / "missing.pt")


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"v": 1})

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        save_file(path, {"v": Unsaveable()})
    assert load_file(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize("field,value,flag", [("epochs", 0, "--epochs"), ("batch_size", -1, "--batch-size"),
                                              ("data", "imagenet", "--data"), ("model", "gpt", "--model"),
                                              ("nproc", "0", "--nproc"), ("synthetic_shape", "3,x", "--synthetic-shape")])
def test_config_errors_name_the_flag(field, value, flag):
    with pytest.raises(UsageError, match=flag):
        TrainConfig(**{field: value})
