"""Functions the CUDA tests (tests/test_cuda.py) run inside launched workers: importable, so
`spawn` finds them. `device_type` is "cuda", or "cpu" when the tests are rehearsed on CPU."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tests.workers import flat_params, toy_data, toy_model


def compiled_steps(device_type: str, steps: int = 6) -> dict:
    """Train a small conv net under `Runtime(compile=True)`; count dynamo's graphs after the first
    step and after the rest (same shapes: nothing more may compile), and train an eager copy on
    the same batches."""
    import ddpkit
    from ddpkit import models
    from ddpkit.strategy import compiled_graphs

    def run(compile: bool) -> tuple[torch.Tensor, list[int], str]:
        counts = []
        with ddpkit.Runtime("single", device=device_type, seed=0, compile=compile, cudnn_benchmark=False) as rt:
            model = models.build("cnn", (3, 16, 16), 10)
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
            g = torch.Generator().manual_seed(1)
            x = torch.randn(steps, 16, 3, 16, 16, generator=g).to(rt.device)
            y = torch.randint(0, 10, (steps, 16), generator=g).to(rt.device)
            for i in range(steps):
                rt.backward(F.cross_entropy(model(x[i]), y[i]))
                rt.step(opt)
                if i == 0 or i == steps - 1:
                    counts.append(compiled_graphs())
            return flat_params(model), counts, str(rt.device)

    eager, _, _ = run(False)
    compiled, counts, device = run(True)
    scale = float(eager.abs().max())
    return {"counts": counts, "max_diff": float((compiled - eager).abs().max()) / scale, "device": device}


def fsdp_one_rank(device_type: str, path: str, precision: str) -> dict:
    """FSDP2 through ddpkit's fsdp strategy in a process group of one rank (NCCL on CUDA), beside
    the bare model on the same batches; then a DCP checkpoint of the sharded model and its
    optimizer, loaded into a differently initialized copy, which must resume bit for bit.

    One GPU holds one NCCL rank, so this is how far FSDP2 and DCP go on a single GPU: the
    collectives run (over one rank), the parameters are DTensors, the checkpoint is DCP's."""
    import torch.distributed as tdist

    from ddpkit import checkpoint
    from ddpkit.checkpoint import shards
    from ddpkit.core.precision import Precision
    from ddpkit.strategy import Single, Strategy
    from ddpkit.strategy.fsdp import FSDP, FSDPOptions, is_sharded

    cuda = device_type == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if cuda else {}
    tdist.init_process_group("nccl" if cuda else "gloo", store=tdist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        g = torch.Generator().manual_seed(2)
        batches = [(torch.randn(16, 6, generator=g).to(device), torch.randint(0, 3, (16,), generator=g).to(device))]
        batches *= 6
        prec = Precision(precision, device)

        def build(strategy: Strategy, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            model = toy_model(seed)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model = strategy.wrap(model, prec)
            strategy.adopt((opt,))
            return model, opt

        def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: list) -> list[float]:
            losses = []
            for x, y in steps:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            return losses

        bare, bare_opt = build(Single(device), 0)
        train(bare, bare_opt, batches[:4])
        fsdp = FSDP(device, FSDPOptions())
        model, opt = build(fsdp, 0)
        losses = train(model, opt, batches[:4])
        sharded = is_sharded(model)
        param_device = str(next(model.parameters()).to_local().device) if sharded else "?"
        diff = float((flat_params(model) - flat_params(bare)).abs().max())
        saved = flat_params(model)
        checkpoint.save(path, {"model": model, "optimizer": opt})
        train(model, opt, batches[4:])
        expected = flat_params(model)
        other = FSDP(device, FSDPOptions())
        copy, copy_opt = build(other, 5)
        checkpoint.load_into(path, {"model": copy, "optimizer": copy_opt})
        restored = torch.equal(flat_params(copy), saved)
        train(copy, copy_opt, batches[4:])
        return {
            "sharded": sharded,
            "param_device": param_device,
            "backend": tdist.get_backend(),
            "max_diff_vs_bare": diff,
            "losses": losses,
            "dcp_directory": shards.is_checkpoint_dir(path),
            "restored_equal": restored,
            "resumed_equal": torch.equal(flat_params(copy), expected),
        }
    finally:
        tdist.destroy_process_group()


def ddp_steps(device_type: str, precision: str, sync_batchnorm: bool = False) -> dict:
    """A few DDP steps on every visible GPU (one process each); with `sync_batchnorm`, a BatchNorm
    net converted to SyncBatchNorm, whose running statistics must then agree on every rank."""
    import ddpkit
    from ddpkit import models

    with ddpkit.Runtime(device=device_type, precision=precision, seed=0) as rt:
        if sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(models.build("fast-cifar", (3, 16, 16), 10))
            data = torch.utils.data.TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,)))
        else:
            model, data = toy_model(), toy_data(64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        for x, y in rt.loader(data, batch_size=16 * rt.world_size):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(opt)
        stats = [
            b.detach().float().cpu() for name, b in ddpkit.Runtime.unwrap(model).named_buffers() if "running" in name
        ]
        return {
            "device": str(rt.device),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "finite": bool(torch.isfinite(flat_params(model)).all()),
            "running_stats": torch.cat([s.reshape(-1) for s in stats]) if stats else None,
        }
