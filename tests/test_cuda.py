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
        return {"device": str(rt.device), "scaler": rt.precision.scaler is not None,
                "finite": bool(torch.isfinite(workers.flat_params(model)).all()),
                "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_single_process_precisions(precision):
    out = _cuda_steps(precision)
    assert out["device"] == "cuda:0" and out["finite"]
    assert out["scaler"] == (precision == "fp16")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs at least 2 GPUs")
def test_nccl_ddp_on_all_visible_gpus():
    n = torch.cuda.device_count()
    out = ddpkit.launch(_cuda_steps, "fp16", nproc=n, device="cuda")
    assert [out[r]["device"] for r in range(n)] == [f"cuda:{r}" for r in range(n)]
    assert {out[r]["backend"] for r in range(n)} == {"nccl"}

