"""The speed features keep the results: the resident loader hands out exactly the DataLoader
path's batches (augmentation included), on any number of ranks; DDP tuning options leave the
weights bit-identical; every run reports its step times, memory and FLOPs."""

from __future__ import annotations

import json

import pytest
import torch

import ddpkit
from ddpkit import data
from tests import workers
from tests.conftest import run_cli

CPU = torch.device("cpu")


def _images(n: int = 300, shape=(3, 12, 12), augment=True) -> data.ImageSet:
    ds = data.synthetic(shape, n, 10, seed=2).train
    ds.augment = data.Augment(crop_padding=3, flip=True) if augment else None
    return ds


@pytest.mark.parametrize("world,micro", [(1, None), (2, None), (3, 7)])
def test_resident_and_dataloader_paths_give_identical_batches(world, micro):
    ds = _images()
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


def test_augmentation_does_not_depend_on_the_number_of_ranks():
    """Step k's augmented samples, over all ranks, are the same for 1 and 3 ranks."""
    ds = _images()

    def step_batches(world):
        per_step = {}
        for rank in range(world):
            loader = data.train_loader(ds, 50, world_size=world, rank=rank, device=CPU, seed=1)
            step = 0
            for x, y in loader:
                per_step.setdefault(step, []).append(x)
                step += loader.current.last
        return {k: torch.cat(v) for k, v in per_step.items()}

    one, three = step_batches(1), step_batches(3)
    assert one.keys() == three.keys()
    assert all(torch.equal(one[k], three[k]) for k in one)


def test_augmentation_changes_samples_and_differs_per_epoch():
    ds = _images(augment=True)
    plain = _images(augment=False)
    keys0 = data.augment_keys(0, 0, torch.arange(len(ds)))
    keys1 = data.augment_keys(0, 1, torch.arange(len(ds)))
    x0, _ = ds.batch(torch.arange(len(ds)), keys0)
    x1, _ = ds.batch(torch.arange(len(ds)), keys1)
    base, _ = plain.batch(torch.arange(len(ds)))
    changed = (x0 != base).flatten(1).any(1).float().mean().item()
    assert changed > 0.9  # 49 crops x 2 flips: about 1 in 98 samples stays as it was
    assert not torch.equal(x0, x1)
    flips = (keys0 & 1).float().mean().item()
    assert 0.4 < flips < 0.6
    assert ds[(3, int(keys0[3]))][0].shape == (3, 12, 12)


def test_evaluation_resident_matches_dataloader():
    ds = _images(n=101, augment=False)
    for world in (1, 3):
        for rank in range(world):
            a = list(data.eval_loader(ds, 20, world_size=world, rank=rank, device=CPU, resident=True))
            b = list(data.eval_loader(ds, 20, world_size=world, rank=rank, device=CPU, resident=False))
            assert len(a) == len(b)
            assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


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


@pytest.mark.parametrize("options", [{"gradient_as_bucket_view": True}, {"static_graph": True},
                                     {"bucket_cap_mb": 0.001}], ids=["bucket-view", "static-graph", "tiny-buckets"])
def test_ddp_tuning_options_keep_the_weights_bit_identical(options):
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    tuned = ddpkit.launch(workers.ddp_options_weights, options, nproc=2, device="cpu")
    assert torch.equal(base[0], base[1]) and torch.equal(tuned[0], tuned[1])
    assert torch.equal(tuned[0], base[0])


def test_fp16_compression_hook_trains_close_to_full_precision():
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    fp16 = ddpkit.launch(workers.ddp_options_weights, {"comm_hook": "fp16"}, nproc=2, device="cpu")
    assert torch.equal(fp16[0], fp16[1])  # every rank applies the same decompressed gradients
    diff = (fp16[0] - base[0]).abs().max().item()
    assert 0 < diff < 1e-2  # rounded to 16 bits on the wire, so close but not equal


def _train(tmp_path, name, *extra):
    out = tmp_path / name
    proc = run_cli("train", "--device", "cpu", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), torch.load(out / "model.pt", weights_only=True), out


AUG = ("--data", "synthetic", "--synthetic-shape", "3,12,12", "--synthetic-size", "256", "--augment", "crop-flip",
       "--crop-padding", "2", "--epochs", "2", "--batch-size", "32", "--model", "cnn")


def test_augmented_training_same_on_both_loaders_and_resumes_bit_identically(tmp_path):
    device, _, _ = _train(tmp_path, "device", *AUG, "--loader", "device", "--nproc", "2")
    dl_r, dl_w, _ = _train(tmp_path, "dataloader", *AUG, "--loader", "dataloader", "--nproc", "2")
    _, dev_w, _ = _train(tmp_path, "device-again", *AUG, "--loader", "device", "--nproc", "2")
    assert all(torch.equal(dl_w[k], dev_w[k]) for k in dev_w)  # the same batches, bit for bit
    assert device["test_accuracy"] == dl_r["test_accuracy"]
    out = tmp_path / "resumed"
    run_cli("train", "--device", "cpu", "--out", str(out), *AUG, "--nproc", "2", "--max-steps", "11")
    _, resumed_w, _ = _train(tmp_path, "resumed", *AUG, "--nproc", "2", "--resume", "auto")
    assert all(torch.equal(resumed_w[k], dev_w[k]) for k in dev_w)  # mid-epoch resume, augmentation and all


def test_every_run_reports_throughput_memory_and_flops(tmp_path):
    r, _, out = _train(tmp_path, "mlp", "--model", "mlp", "--epochs", "2", "--nproc", "2")
    t = r["step_time_ms"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"]
    assert r["steady_steps"] + r["warmup_steps"] == r["steps"] and r["warmup_steps"] >= 1
    assert len(r["peak_memory_mib"]) == 2 and min(r["peak_memory_mib"]) > 50  # RSS of a torch process
    # mlp on 8x8 digits: 64-30-20-10 linear layers; forward 2 FLOPs per weight, backward twice
    # that, except the first layer's, which needs no gradient for its input
    assert r["flops_per_sample"] == 3 * 2 * (30 * 20 + 20 * 10) + 2 * 2 * 64 * 30
    assert r["achieved_tflops"] == pytest.approx(r["flops_per_sample"] * r["samples_per_second"] / 1e12)
    assert r["mfu"] is None and r["gpu_utilization_percent"] is None  # CPU: no peak, no NVML


def test_channels_last_trains_to_the_same_result(tmp_path):
    plain, plain_w, _ = _train(tmp_path, "plain", "--epochs", "1")
    nhwc, nhwc_w, _ = _train(tmp_path, "nhwc", "--epochs", "1", "--channels-last")
    assert max((plain_w[k] - nhwc_w[k]).abs().max().item() for k in plain_w) < 1e-4
    assert all(not k.startswith("module.") for k in nhwc_w)


def test_model_recipe_defaults_yield_to_yaml_and_flags(tmp_path):
    import yaml

    base = ("--model", "fast-cifar", "--data", "synthetic", "--synthetic-size", "48", "--synthetic-shape", "3,16,16",
            "--epochs", "1", "--eval-batch-size", "64")
    _, _, out = _train(tmp_path, "recipe", *base)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["batch_size"], cfg["label_smoothing"], cfg["augment"]) == (1024, 0.2, "crop-flip")
    assert cfg["precision"] == "fp32" and not cfg["channels_last"]  # the GPU part of the recipe: not on CPU
    conf = tmp_path / "c.yaml"
    conf.write_text("label_smoothing: 0.1\nbatch_size: 32\n")
    _, _, out = _train(tmp_path, "override", *base, "--config", str(conf), "--batch-size", "16")
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert (cfg["label_smoothing"], cfg["batch_size"], cfg["lr"]) == (0.1, 16, 0.4)


@pytest.mark.parametrize("flags,needle", [
    (("--augment", "crop-flip", "--model", "mlp", "--data", "synthetic", "--synthetic-shape", "20"), "--augment"),
    (("--comm-hook", "int8"), "--comm-hook"),
    (("--comm-hook", "bf16", "--device", "cpu"), "--comm-hook bf16 needs CUDA"),
    (("--label-smoothing", "1.5"), "--label-smoothing"),
    (("--loader", "disk"), "--loader"),
    (("--bucket-cap-mb", "0"), "--bucket-cap-mb"),
], ids=["augment-non-image", "comm-hook", "bf16-hook-on-cpu", "label-smoothing", "loader", "bucket"])
def test_bad_speed_flags_exit_2_with_one_line(tmp_path, flags, needle):
    proc = run_cli("train", "--out", str(tmp_path / "o"), *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()
