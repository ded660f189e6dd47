"""Streams for the tests of ddpkit.data.stream, and the function the launched workers run.

The stream: N toy samples (x, y, id) in an order drawn from the epoch, so set_epoch reshuffles
it and every rank and pass reads the same. With B=7 an epoch is global batches of 7, 7, 7 and
2: on 3 ranks the full ones split 3/2/2 (2/1/1 micro-batches of 2, which fsdp's lockstep pads)
and the last one 1/1/0 (an empty share).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

import ddpkit
from tests.workers import flat_params, toy_data, toy_model

N, B, MICRO, EPOCHS = 23, 7, 2, 3  # 4 global batches per epoch, 12 steps in all
# The step after which a run on W processes stops and saves: mid-epoch 0; after epoch 0's last
# step (its end not read yet); before epoch 1's short last batch.
STOPS = {1: 2, 2: 4, 3: 7}


def order(epoch: int, n: int = N) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


def expected(epoch: int, n: int = N, batch: int = B) -> list[list[int]]:
    """The ids of each global batch of `epoch`, as one process reads them."""
    ids = order(epoch, n)
    return [ids[k : k + batch] for k in range(0, n, batch)]


class Stream(IterableDataset):
    """A deterministic stream; counts the samples it yields and the epochs it is given."""

    def __init__(self, n: int = N):
        self.x, self.y = toy_data(n, seed=2).tensors
        self.n, self.epoch, self.yielded, self.epochs = n, 0, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    def samples(self, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        for i in order(self.epoch, self.n)[start:]:
            self.yielded += 1
            yield self.x[i], self.y[i], i

    def __iter__(self) -> Iterator[Any]:
        return self.samples()


class Skippable(Stream):
    """The same stream, with the hook that starts it mid-way without reading the rest."""

    def iter_from(self, start: int) -> Iterator[Any]:
        return self.samples(start)


class Sized(Stream):
    def __len__(self) -> int:
        return self.n


def plain_reference() -> torch.Tensor:
    """EPOCHS epochs over the stream in plain PyTorch on one process: the mean loss of each
    whole global batch, momentum SGD."""
    model = toy_model(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x, y = toy_data(N, seed=2).tensors
    for epoch in range(EPOCHS):
        for ids in expected(epoch):
            F.cross_entropy(model(x[ids]), y[ids]).backward()
            opt.step()
            opt.zero_grad()
    return flat_params(model)


def _setup(rt: ddpkit.Runtime, dataset: Stream, micro: int | None) -> tuple:
    model = rt.build(lambda: toy_model(seed=5))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = rt.setup(model, opt)
    return model, opt, rt.loader(dataset, batch_size=B, micro_batch_size=micro)


def _train_on(rt: ddpkit.Runtime, model, opt, loader, batch, log: list, loop_epoch: int | None = None) -> bool:
    """One micro-batch: logged (what the loader said about it), backward, step."""
    x, y, ids = batch
    info = loader.current
    step = loader.position - info.last  # the last micro-batch of a step has counted it already
    log.append(
        {
            "loop": loop_epoch,
            "epoch": loader.epoch,
            "step": step,
            "ids": ids.tolist(),
            "size": info.size,
            "step_size": info.step_size,
            "last": info.last,
            "shape": tuple(x.shape),
        }
    )
    rt.backward(F.cross_entropy(model(x), y))
    return rt.step(opt)


def count_loop(rt: ddpkit.Runtime, micro: int | None, stop: int, save: str) -> dict:
    """12 steps counted, with a break after `stop` steps where the state is saved (the loader
    as a plain state_dict), then the same loader goes on."""
    model, opt, loader = _setup(rt, Stream(), micro)
    log, done, saved = [], 0, None
    while done < EPOCHS * 4:
        for batch in loader:
            done += _train_on(rt, model, opt, loader, batch, log)
            if done == stop and saved is None:
                saved = loader.state_dict()
                rt.save(save, model=model, optimizer=opt, loader=loader)
                break
    return {"log": log, "params": flat_params(model), "saved": saved}


def epoch_loop(rt: ddpkit.Runtime, micro: int | None, dataset: Stream, resume: str | None = None) -> dict:
    """`for epoch in range(loader.epoch, EPOCHS): for batch in loader`, from the start or from a
    checkpoint another world size saved."""
    model, opt, loader = _setup(rt, dataset, micro)
    if resume is not None:
        rt.load(resume, model=model, optimizer=opt, loader=loader)
    log, passes = [], []
    for epoch in range(loader.epoch, EPOCHS):
        before = len(log)
        for batch in loader:
            _train_on(rt, model, opt, loader, batch, log, loop_epoch=epoch)
        passes.append(sum(entry["last"] for entry in log[before:]))  # global batches in this pass
    return {"log": log, "params": flat_params(model), "passes": passes, "yielded": dataset.yielded}


def stream_runs(save: str, resume: str | None, fsdp: bool = False) -> dict:
    """Every stream run one world size makes, in one job: micro-batches with a stop and save
    (`count_loop`), whole batches (`epoch_loop`), a resume of another world size's checkpoint
    (through `iter_from` on 1 and 2 processes, by reading the stream on 3), and fsdp."""
    with ddpkit.Runtime(device="cpu", seed=5, timeout_s=60) as rt:
        out = {"stopped": count_loop(rt, MICRO, STOPS[rt.world_size], save)}
        out["whole"] = epoch_loop(rt, None, Stream())
        if resume is not None:
            dataset = Stream() if rt.world_size == 3 else Skippable()
            out["resumed"] = epoch_loop(rt, MICRO, dataset, resume)
        if fsdp:
            with ddpkit.Runtime("fsdp", device="cpu", seed=5, timeout_s=60) as sharded:
                out["fsdp"] = epoch_loop(sharded, MICRO, Stream())
        return out
