"""GPU paths: NCCL, CUDA autocast with GradScaler, device binding. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from tests import workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_steps(precision: str) -> dict:
    import torch.nn.functional as F

    with ddpkit.Runtime(device="cuda", precision=precision, seed=0) as rt:
        model = workers.toy_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        for x, y in rt.loader(workers.toy_data(64), batch_size=16 * rt.world_size):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(opt)
        return {
            "device": str(rt.device),
            "scaler": rt.precision.scaler is not None,
            "finite": bool(torch.isfinite(workers.flat_params(model)).all()),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        }


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_single_process_precisions(precision):
    out = _cuda_steps(precision)
    assert out["device"] == "cuda:0" and out["finite"]
    assert out["scaler"] == (precision == "fp16")


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs at least 2 GPUs")
def test_nccl_ddp_on_all_visible_gpus():
    n = torch.cuda.device_count()
    out = ddpkit.launch(_cuda_steps, "fp16", nproc=n, device="cuda")
    assert [out[r]["device"] for r in range(n)] == [f"cuda:{r}" for r in range(n)]
    assert {out[r]["backend"] for r in range(n)} == {"nccl"}


@pytest.mark.unit
def test_cuda_resident_loader_matches_dataloader_path_with_augmentation():
    from ddpkit import data

    ds = data.synthetic((3, 32, 32), 512, 10, seed=0).train
    ds.augment = data.Augment(crop_padding=4, flip=True)
    cuda = torch.device("cuda", 0)
    resident = data.train_loader(ds, 128, world_size=1, rank=0, device=cuda, seed=3, resident=True)
    loader = data.train_loader(ds, 128, world_size=1, rank=0, device=cuda, seed=3, resident=False)
    for (xa, ya), (xb, yb) in zip(list(resident), list(loader)):
        assert xa.is_cuda and xb.is_cuda
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the hash gives the same crops on GPU


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,channels_last,compile", [("bf16", True, False), ("fp16", True, False), ("bf16", True, True)]
)
def test_cuda_fast_cifar_trains_with_speed_flags(tmp_path, precision, channels_last, compile):
    import json

    from tests.conftest import run_cli

    out = tmp_path / "out"
    flags = (
        ["--precision", precision] + (["--channels-last"] if channels_last else []) + (["--compile"] if compile else [])
    )
    proc = run_cli(
        "train",
        "--device",
        "cuda",
        "--nproc",
        "1",
        "--model",
        "fast-cifar",
        "--data",
        "synthetic",
        "--synthetic-size",
        "4096",
        "--batch-size",
        "512",
        "--epochs",
        "3",
        "--out",
        str(out),
        *flags,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["test_accuracy"] > 0.3  # synthetic class templates: well above the 0.1 of chance
    assert r["mfu"] is None or 0 < r["mfu"] < 1
    assert r["peak_memory_kind"] == "cuda_max_allocated"
    if compile:
        assert r["compile_seconds"] > 0
