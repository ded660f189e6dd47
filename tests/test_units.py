"""Small pieces in one process: environment detection, samplers, checkpoints, config."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import data, dist, models
from ddpkit.checkpoint import load_file, save_file
from ddpkit.device import auto_nproc
from ddpkit.trainer import TrainConfig, resolve
from ddpkit.errors import UsageError
from ddpkit.launcher import parse_nproc
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


def test_global_batch_shares():
    with pytest.raises(ValueError, match="smaller than the 4 processes"):
        data.check_global_batch(3, 4)
    assert [data.share(64, 3, r) for r in range(3)] == [(0, 22), (22, 21), (43, 21)]
    assert [data.share(2, 3, r) for r in range(3)] == [(0, 1), (1, 1), (2, 0)]  # an empty share is allowed


@pytest.mark.parametrize("n,batch,micro", [(50, 8, None), (50, 7, 2), (10, 4, 3), (5, 5, None), (11, 10, 1)])
def test_global_order_does_not_depend_on_world_size(n, batch, micro):
    """Step k's samples, over all ranks and micro-batches, are the same for 1, 2 and 3 ranks."""
    def steps(world):
        out = {}
        for rank in range(world):
            s = data.GlobalBatchSampler(n, batch, world, rank, seed=3, micro_batch_size=micro)
            s.set_epoch(1)
            step = 0
            for indices, info in s.plan():
                out.setdefault(step, []).extend(indices)
                assert info.step_size == len(out[step]) or not info.last or world > 1
                if micro:
                    assert len(indices) <= micro
                step += info.last
        return {k: sorted(v) for k, v in out.items()}

    one = steps(1)
    assert sorted(i for v in one.values() for i in v) == list(range(n))  # each sample once per epoch
    assert steps(2) == one and steps(3) == one


def test_resuming_mid_epoch_yields_exactly_the_rest():
    full = data.GlobalBatchSampler(30, 4, 2, 1, seed=0)
    full.set_epoch(2)
    rest = data.GlobalBatchSampler(30, 4, 3, 1, seed=0)  # resumed on another world size
    rest.set_epoch(2, start_step=5)
    one = data.GlobalBatchSampler(30, 4, 1, 0, seed=0)
    one.set_epoch(2, start_step=5)
    assert sum((idx for idx, _ in one.plan()), []) == full.order()[20:].tolist()
    assert len(list(rest.plan())) == full.steps_per_epoch - 5


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
    if min(shape[1:]) < models.MIN_SIZE.get(name, 1):
        with pytest.raises(ValueError, match="at least"):
            models.build(name, shape, 10)
        return
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
        resolve(TrainConfig(**{field: value}))


def test_autocast_module_runs_inner_layers_in_bf16_and_returns_fp32():
    import copy
    import pickle as pk
    from collections import namedtuple

    import ddpkit

    Out = namedtuple("Out", "logits aux")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return Out(self.lin(x), {"h": self.lin(x)})

    seen = []
    with ddpkit.Runtime(precision="bf16", device="cpu") as rt:
        net = Net()
        net.lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        model = rt.setup(net)
        out = model(torch.randn(2, 4))
    assert seen == [torch.bfloat16, torch.bfloat16]  # autocast really ran inside
    assert isinstance(out, Out) and out.logits.dtype == torch.float32 and out.aux["h"].dtype == torch.float32
    assert unwrap(model) is net and list(unwrap(model).state_dict()) == ["lin.weight", "lin.bias"]
    twin = copy.deepcopy(model)  # a copy (EMA, teacher) must be its own model, not a view of this one
    with torch.no_grad():
        unwrap(twin).lin.weight.zero_()
        unwrap(twin).lin.bias.zero_()
    assert torch.count_nonzero(twin(torch.randn(2, 4)).logits) == 0
    assert torch.count_nonzero(model(torch.randn(2, 4)).logits) > 0
    with ddpkit.Runtime(precision="bf16", device="cpu") as rt:
        plain = rt.setup(nn.Linear(4, 3))
    assert torch.equal(pk.loads(pk.dumps(plain)).module.weight, plain.module.weight)  # still pickles


def test_single_strategy_on_several_processes_is_refused():
    from ddpkit.strategy import resolve_name

    assert resolve_name("single", 1, torch.device("cpu")) == "single"
    with pytest.raises(ValueError, match="unsynchronized"):
        resolve_name("single", 2, torch.device("cpu"))


def test_loader_left_early_continues_where_it_stopped():
    loader = data.train_loader(TensorDataset(torch.arange(64)), 8, world_size=1, rank=0,
                               device=torch.device("cpu"), seed=0)
    order = loader.sampler.order().tolist()
    firsts = []
    for _ in range(3):
        for (batch,) in loader:
            firsts.append(batch.tolist())
            break
    assert firsts == [order[0:8], order[8:16], order[16:24]]  # neither replayed nor skipped
    assert (loader.epoch, loader.position) == (0, 3)
    assert len(loader) == 5 and len(list(loader)) == 5  # the rest of the epoch
    assert (loader.epoch, loader.position) == (1, 0)
    assert next(iter(loader))[0].tolist() != order[0:8]  # epoch 1 reshuffles


@pytest.mark.parametrize("name,shape", [("lenet", (3, 2, 2)), ("cnn", (1, 1, 1)), ("cnn", (10,))])
def test_model_input_checks(name, shape):
    with pytest.raises(ValueError, match=name):
        models.check(name, shape)


def test_resume_auto_needs_out():
    with pytest.raises(UsageError, match="--resume auto needs --out"):
        resolve(TrainConfig(resume="auto"))


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


def test_on_nonfinite_skip_drops_that_step_on_every_rank(tmp_path):
    import json

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
            loop.check_finite()  # would raise on NaN weights: the bad step never reached them
    assert loop.run.skipped == 1 and loop.run.step == 23
    skips = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["type"] == "skip"]
    assert [r["step"] for r in skips] == [3]


def test_runtime_forgets_the_micro_batch_when_a_pass_ends():
    import ddpkit

    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = rt.setup(nn.Linear(2, 1))
        loader = rt.loader(TensorDataset(torch.randn(8, 2)), batch_size=8, micro_batch_size=4)
        for (x,) in loader:
            break  # left after the first of two micro-batches
        assert rt.step_ready  # not stuck waiting for a micro-batch that will not come
        x = torch.ones(1, 2)
        model(x).sum().backward()
        plain = model.weight.grad.clone()
        model.zero_grad()
        rt.backward(model(x).sum())  # a batch from elsewhere: no training-batch weighting
        assert torch.equal(model.weight.grad, plain)
