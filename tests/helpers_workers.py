"""Workers for tests/test_loop_helpers.py (importable, so `spawn` finds them): DDP's options, early
stopping agreed by every rank, and the EMA, each run in one job of N processes (and in the test
process itself, as one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from tests.workers import flat_params, toy_data, toy_model

EMA_DECAY = 0.8


class Branchy(nn.Module):
    """A model whose `spare` head never takes part in the forward: DDP waits for its gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk, self.head, self.spare = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(x)))


def train(rt: ddpkit.Runtime, model: nn.Module, steps: int, ema: bool = False) -> dict:
    """`steps` SGD steps at global batch 12 (an EMA updated after each); the weights after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = rt.setup(model, opt)
    average = ddpkit.EMA(model, EMA_DECAY) if ema else None
    snapshots = [flat_params(model)]
    loader = rt.loader(toy_data(48, seed=2), batch_size=12)
    for _, (x, y) in zip(range(steps), loader):
        rt.backward(F.cross_entropy(model(x), y))
        if rt.step(opt) and average is not None:
            average.update()
        snapshots.append(flat_params(model))
    return {"model": model, "ema": average, "snapshots": snapshots}


def unused_parameters() -> dict:
    """Branchy trained with find_unused_parameters (the Runtime's own option) and an EMA (under
    DDP: whole on every rank), and the error torch raises at the second step (3+ ranks: the
    first) without the option (None on one process: no DDP there)."""
    with ddpkit.Runtime(device="cpu", seed=3, ddp={"find_unused_parameters": True}) as rt:
        run = train(rt, Branchy(), steps=4, ema=True)
        allowed, ema = run["snapshots"][-1], averaged(run["model"], run["ema"])
    with ddpkit.Runtime(device="cpu", seed=3) as rt:  # the default: unused parameters not allowed
        try:
            train(rt, Branchy(), steps=2)
            error = None
        except RuntimeError as err:
            error = str(err)
    return {"weights": allowed, "ema": ema, "error": error}


def broadcast_buffers(on: bool) -> list[torch.Tensor]:
    """Every rank's BatchNorm running mean after a training forward on data of its own, then an
    evaluation forward (which changes no statistics): DDP copies rank 0's buffers to every rank
    before a forward when `on`."""
    with ddpkit.Runtime(device="cpu", ddp={"broadcast_buffers": on}) as rt:
        model = rt.setup(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
        model(torch.randn(8, 6) + rt.rank).sum().backward()
        model.eval()
        with torch.no_grad():
            model(torch.zeros(2, 6))
        return rt.all_gather(rt.unwrap(model)[1].running_mean.clone())


def stop_together(epochs: int = 8) -> dict:
    """Only rank 1's view of the monitored value stops improving (from epoch 2 on); every rank
    must leave the loop at the same epoch. A barrier stands for an epoch's collectives: a rank
    that left alone would leave the others waiting there until the timeout."""
    with ddpkit.Runtime(device="cpu") as rt:
        stopper = ddpkit.EarlyStopping(patience=2)
        for epoch in range(1, epochs + 1):
            rt.barrier()
            value = 1.0 if rt.rank == 1 else 1.0 / epoch
            if stopper.step(value, rt):
                break
        rt.barrier()
        return {
            "epoch": epoch,
            "own_bad_checks": stopper.bad_checks,
            "any": (rt.any_rank(rt.rank == 1), rt.any_rank(False)),
        }


def ema_steps(path: str, load_from: str | None = None) -> dict:
    """4 steps of the toy model under fsdp (one process: single) with an EMA; the weights after
    each step and the average; then saved with the model to `path` (fsdp: a checkpoint
    directory of shards), read back into a fresh EMA, and `load_from` (another world size's
    checkpoint) read into another."""
    with ddpkit.Runtime("fsdp", device="cpu", seed=5) as rt:
        run = train(rt, rt.build(lambda: toy_model(seed=5)), steps=4, ema=True)
        model, ema = run["model"], run["ema"]
        out = {"snapshots": run["snapshots"], "sharded": ema.sharded, "ema": averaged(model, ema)}
        rt.save(path, model=model, ema=ema)
        out["reloaded"] = loaded(rt, model, path)
        out["loaded"] = loaded(rt, model, load_from) if load_from else None
        out["weights"] = flat_params(model)  # the model's own, after all that swapping
        return out


def averaged(model: nn.Module, ema: ddpkit.EMA) -> torch.Tensor:
    with ema.swapped():
        return flat_params(model)  # fsdp: the shards gathered whole


def loaded(rt: ddpkit.Runtime, model: nn.Module, path: str) -> torch.Tensor:
    fresh = ddpkit.EMA(model, EMA_DECAY)  # starts from the current weights
    rt.load(path, ema=fresh)
    return averaged(model, fresh)


def loop_helpers(path: str, load_from: str) -> dict:
    """Everything above in one job, with a timeout short enough that a rank left waiting fails
    the test rather than hanging it."""
    with ddpkit.Runtime(device="cpu", timeout_s=60):
        return {
            "stop": stop_together(),
            "buffers": {on: broadcast_buffers(on) for on in (True, False)},
            "ema": ema_steps(path, load_from),
            "unused": unused_parameters(),  # last: its failing half leaves DDP's reducer mid-step
        }
