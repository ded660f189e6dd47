"""`loader`: a loader left early continues where it stopped; the device-resident path hands out
exactly the DataLoader path's batches (augmentation included) on any number of ranks, in
training and evaluation and in a real `ddpkit train` run, and refuses what it cannot hold."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit import data
from tests.conftest import run_cli, run_train
from tests.data.helpers import CPU, image_set


@pytest.mark.unit
def test_loader_left_early_continues_where_it_stopped():
    loader = data.train_loader(
        TensorDataset(torch.arange(64)), 8, world_size=1, rank=0, device=torch.device("cpu"), seed=0
    )
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


@pytest.mark.unit
def test_a_loader_restored_at_an_epochs_last_step_ends_that_epoch_without_another_pass():
    def make():
        ds = TensorDataset(torch.arange(64))
        return data.train_loader(ds, 8, world_size=1, rank=0, device=torch.device("cpu"), seed=0)

    loader = make()
    for i, _ in enumerate(loader):  # a checkpoint taken after the epoch's last step, before it ended
        if i == 7:
            state = loader.state_dict()
            break
    assert state == {"epoch": 0, "position": 8}
    restored = make()
    restored.load_state_dict(state)
    assert list(restored) == [] and (restored.epoch, restored.position) == (1, 0)  # what was left of epoch 0
    assert [b.tolist() for (b,) in restored] == [b.tolist() for (b,) in _at(make(), 1)]  # then epoch 1
    # A loader the caller left at the last step itself (no checkpoint) goes on with the next epoch.
    assert len(list(loader)) == 8 and loader.epoch == 2


def _at(loader, epoch: int):
    loader.load_state_dict({"epoch": epoch, "position": 0})
    return loader


@pytest.mark.unit
@pytest.mark.parametrize("world,micro", [(1, None), (2, None), (3, 7)])
def test_resident_and_dataloader_paths_give_identical_batches(world, micro):
    ds = image_set()
    for rank in range(world):
        kw = dict(world_size=world, rank=rank, device=CPU, seed=5, micro_batch_size=micro)
        resident = data.train_loader(ds, 64, resident=True, **kw)
        loader = data.train_loader(ds, 64, resident=False, **kw)
        assert resident.resident is not None and loader.resident is None
        count = 0
        for _ in range(2):  # two epochs: the second reshuffles and re-augments
            for (xa, ya), (xb, yb) in zip(list(resident), list(loader)):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
                count += 1
        assert count == 2 * len(list(data.GlobalBatchSampler(len(ds), 64, world, rank, micro_batch_size=micro).spans()))


@pytest.mark.unit
@pytest.mark.parametrize("count", [1, 2, 3])
def test_resident_tensor_gathers_match_the_dataloader(count):
    # one, two (written out) and three tensors, of several shapes and dtypes
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(90, 3, 4, generator=g),
        torch.randint(0, 10, (90,), generator=g),
        torch.rand(90, 2, generator=g) > 0.5,
    ][:count]
    if count == 3:  # kinds index_select would change or refuse: gathered as t[i]
        tensors += [
            torch.randn(90, 3, 2, 2, generator=g).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 60000, (90,), generator=g).to(torch.uint16),  # (no 1-D kernel)
        ]
    ds = TensorDataset(*tensors)
    for world, rank in ((1, 0), (2, 1)):
        kw = dict(world_size=world, rank=rank, device=CPU, seed=3, micro_batch_size=None)
        resident = data.train_loader(ds, 16, resident=True, **kw)
        loader = data.train_loader(ds, 16, resident=False, **kw)
        assert resident.resident is not None and loader.resident is None
        a, b = list(resident), list(loader)
        assert len(a) == len(b) == -(-90 // 16)
        for p, q in zip(a, b):
            assert len(p) == len(q) == len(tensors)
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(p, q))
            # and the memory layout a hand-written t[i] gives (the DataLoader's collate does not keep it)
            i = torch.tensor([0, 1])
            assert [x.stride()[1:] for x in p] == [t[i].stride()[1:] for t in tensors]


@pytest.mark.unit
def test_evaluation_resident_matches_dataloader():
    ds = image_set(n=101, augment=False)
    for world in (1, 3):
        for rank in range(world):
            a = list(data.eval_loader(ds, 20, world_size=world, rank=rank, device=CPU, resident=True))
            b = list(data.eval_loader(ds, 20, world_size=world, rank=rank, device=CPU, resident=False))
            assert len(a) == len(b)
            assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.unit
def test_resident_loader_refuses_a_dataset_it_cannot_hold():
    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(2), 0

    with pytest.raises(ValueError, match="resident"):
        data.train_loader(Files(), 2, world_size=1, rank=0, device=CPU, resident=True)
    auto = data.train_loader(Files(), 2, world_size=1, rank=0, device=CPU)  # auto falls back
    assert auto.resident is None and len(list(auto)) == 2


AUG = (
    "--data",
    "synthetic",
    "--synthetic-shape",
    "3,12,12",
    "--synthetic-size",
    "256",
    "--augment",
    "crop-flip",
    "--crop-padding",
    "2",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--model",
    "cnn",
)


@pytest.mark.cli
@pytest.mark.slow
def test_augmented_training_same_on_both_loaders_and_resumes_bit_identically(tmp_path):
    device, dev_w, _ = run_train(tmp_path, "device", *AUG, "--loader", "device", "--nproc", "2")
    dl_r, dl_w, _ = run_train(tmp_path, "dataloader", *AUG, "--loader", "dataloader", "--nproc", "2")
    assert all(torch.equal(dl_w[k], dev_w[k]) for k in dev_w)  # the same batches, bit for bit
    assert device["test_accuracy"] == dl_r["test_accuracy"]
    out = tmp_path / "resumed"
    stopped = run_cli("train", "--device", "cpu", "--out", str(out), *AUG, "--nproc", "2", "--max-steps", "11")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    _, resumed_w, _ = run_train(tmp_path, "resumed", *AUG, "--nproc", "2", "--resume", "auto")
    assert all(torch.equal(resumed_w[k], dev_w[k]) for k in dev_w)  # mid-epoch resume, augmentation and all


@pytest.mark.unit
def test_an_evaluation_pass_leaves_the_process_random_stream_as_it_was():
    # A DataLoader's pass draws its workers' base seed from torch's stream unless it has a
    # generator: an evaluation between steps moved the training's stream, so a full state saved
    # before it resumed to other dropout masks than the run that went on
    import ddpkit

    class Pairs(torch.utils.data.Dataset):  # not device-resident: read through a DataLoader
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int):
            return torch.full((4,), float(i)), torch.tensor(i % 2)

    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = rt.setup(torch.nn.Linear(4, 2))
        before = torch.get_rng_state()
        result = rt.evaluate(model, Pairs(), batch_size=4)
        assert result["samples"] == 10
        assert torch.equal(torch.get_rng_state(), before)
