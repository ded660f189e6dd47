"""Workers for tests/test_gather.py: one job per world size runs every check and returns what
the test compares with the dataset's own order and a plain one-process forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.runtime.gather import Collector

# (samples, global eval batch): uneven shares; ranks with different batch counts (with 2 or 3
# ranks); multi-sample batches; fewer samples than 3 ranks (rank 2's share is empty).
CASES = ((11, 2), (13, 6), (2, 2))


def indexed(n: int) -> TensorDataset:
    """Features, float64 regression targets, and each sample's index."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return TensorDataset(
        x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64), torch.arange(n)
    )


def regressor() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(4, 1).double()


def mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().squeeze(1)


def squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).squeeze(1)


def pair(out: torch.Tensor, y: torch.Tensor) -> dict:
    return {"pred": out, "target": y}


def gather_checks() -> dict:
    """Every gather and evaluate check on this job's world size, from each rank."""
    with ddpkit.Runtime(device="cpu") as rt:
        out = {"gathered": {}, "batches": {}, "evaluate": {}}
        for n, batch in CASES:
            out["gathered"][n], out["batches"][n] = _gathered(rt, indexed(n), batch)
            for strategy in ("ddp", "fsdp"):
                out["evaluate"][strategy, n] = _evaluated(strategy, indexed(n), batch)
        out["errors"] = _errors(rt, indexed(11))
        return out


def _gathered(rt: ddpkit.Runtime, data: TensorDataset, batch: int) -> tuple[dict, int]:
    """The dataset gathered batch by batch (a Collector: tensors, strings, a nested tuple) and
    as whole-share values (None from an empty share); and this rank's batch count."""
    seen, batches = Collector(), 0
    for x, _, i in rt.eval_loader(data, batch_size=batch):
        seen.add({"x": x, "i": (i, [f"sample {k}" for k in i.tolist()])})
        batches += 1
    whole = seen.values()
    return {"collected": rt.gather(seen), "whole": rt.gather(None if whole is None else whole["i"][0])}, batches


def _evaluated(strategy: str, data: TensorDataset, batch: int) -> dict:
    """rt.evaluate of the regressor with an MSE loss, two metrics and gathered outputs (a
    Runtime inside the job's: it uses the group that exists)."""
    with ddpkit.Runtime(strategy, device="cpu") as rt:
        model = rt.setup(regressor())
        two = TensorDataset(*data.tensors[:2])
        return rt.evaluate(model, two, F.mse_loss, batch, metrics={"mae": mae, "squared": squared}, outputs=pair)


def _errors(rt: ddpkit.Runtime, data: TensorDataset) -> dict:
    """The UsageError messages (or None) for a pass cut short on the last rank, a dtype that
    differs there, and a metric that is no per-sample value."""
    indices = [i for _, _, i in rt.eval_loader(data, batch_size=2)]
    last = rt.rank == rt.world_size - 1
    partial = torch.cat(indices[:-1] if last else indices)
    mixed = torch.cat(indices).to(torch.int32 if last else torch.int64)
    model = rt.setup(regressor())
    two = TensorDataset(*data.tensors[:2])
    calls = {
        "partial": lambda: rt.gather(partial),
        "dtype": lambda: rt.gather({"i": mixed}),
        "metric": lambda: rt.evaluate(model, two, F.mse_loss, metrics={"mean": lambda o, y: (o - y).mean()}),
    }
    return {name: _message(call) for name, call in calls.items()}


def _message(call) -> str | None:
    try:
        call()
    except ddpkit.UsageError as err:
        return str(err)
    return None
