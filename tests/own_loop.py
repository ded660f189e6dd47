"""Worker functions for the own-loop tests (tests/test_own_loop.py): a small model of token
sequences of varying length, a padding collate, token-weighted updates, DataLoaders handed to
`rt.loader`, full-state save and resume, main_first. Importable, so spawned workers find them."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddpkit

VOCAB, PAD, IGNORE = 11, 0, -100


class Sequences(Dataset):
    """`n` token sequences of 1 to 8 tokens: (inputs, next-token targets)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, 9, (n,), generator=g).tolist()
        self.seqs = [torch.randint(1, VOCAB, (k + 1,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seqs[i]
        return s[:-1], s[1:]


def pad(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad inputs with PAD and targets with IGNORE to the longest sequence of the batch."""
    xs, ys = zip(*samples)
    x = nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=PAD)
    y = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=IGNORE)
    return x, y


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(x)))


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the real tokens, and how many there are."""
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    return loss, (y != IGNORE).sum()


def params(model: nn.Module) -> torch.Tensor:
    ps = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ddpkit.Runtime.unwrap(model).parameters()]
    return torch.cat([p.detach().reshape(-1).cpu() for p in ps])


def plain_token_mean(steps: int, batch: int, n: int = 30) -> torch.Tensor:
    """Plain PyTorch on one process, no ddpkit: each step the mean loss over every real token
    of the global batch, in the order ddpkit's sampler draws (seed 0 + epoch)."""
    data = Sequences(n)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    done, epoch = 0, 0
    while done < steps:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        for k in range(0, n, batch):
            x, y = pad([data[i] for i in order[k : k + batch]])
            token_loss(model(x), y)[0].backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                return params(model)
        epoch += 1
    return params(model)


def token_weighted(
    steps: int, batch: int, micro: int | None, weighted: bool = True, via_dataloader: bool = False
) -> dict:
    """`steps` steps of TinyLM through rt.loader with the padding collate, each micro-batch's
    backward weighted by its tokens (or, `weighted` False, by samples: rt.backward's default)."""
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = TinyLM()
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        data = Sequences(30)
        if via_dataloader:
            loader = rt.loader(DataLoader(data, batch_size=batch, shuffle=True, collate_fn=pad), micro_batch_size=micro)
        else:
            loader = rt.loader(data, batch_size=batch, micro_batch_size=micro, collate_fn=pad)
        done = 0
        while done < steps:
            for x, y in loader:
                loss, tokens = token_loss(model(x), y)
                rt.backward(loss, weight=tokens if weighted else None)
                if rt.step(opt):
                    done += 1
                    if done == steps:
                        break
        return {"params": params(model), "position": loader.state_dict()}


def custom_loop(
    stop_at: int | None,
    steps: int,
    path: str,
    resume: bool = False,
    strategy: str = "ddp",
    dropout: float = 0.0,
) -> dict:
    """A custom loop with a scheduler, micro-batches, a loader over a DataLoader and an
    evaluation loader: trains until `steps` (saving the full state and returning at `stop_at`,
    if given); with `resume`, first continues from `path`."""
    with ddpkit.Runtime(strategy, device="cpu", seed=3) as rt:
        model = rt.build(lambda: TinyLM(dropout))
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        loader = rt.loader(DataLoader(Sequences(29), batch_size=6, shuffle=True, collate_fn=pad), micro_batch_size=2)
        step = 0
        if resume:
            step = rt.load_state(path, scheduler=sched)["step"]
        while step < steps:
            for x, y in loader:
                loss, tokens = token_loss(model(x), y)
                rt.backward(loss, weight=tokens)
                if rt.step(opt):
                    sched.step()
                    step += 1
                    if step == stop_at:
                        rt.save_state(path, scheduler=sched, step=step)
                        return {"stopped": step, "position": loader.state_dict()}
                    if step == steps:
                        break
        return {"params": params(model), "position": loader.state_dict(), "lr": sched.get_last_lr()[0]}


def main_first_order(folder: str) -> list[str]:
    """Inside rt.main_first(), rank 0 writes a file that the other ranks then find."""
    with ddpkit.Runtime(device="cpu") as rt:
        marker = os.path.join(folder, "downloaded")
        with rt.main_first():
            seen = sorted(os.listdir(folder))
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(rt.rank))
        return seen


class Checkpointed(nn.Module):
    """Two layers, the first under reentrant activation checkpointing: its parameters get their
    gradients from a backward run inside the checkpoint's own."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True)
        return self.b(h.relu())

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The same without checkpointing (whose reentrant form torch.autograd.grad refuses)."""
        return self.b(self.a(x).relu())


def first_backward(weight: bool, checkpointed: bool = False) -> dict:
    """The first reducing backward on 3 ranks, which Runtime.backward runs in DDP's rebuilt
    buckets (strategy.settled_backward: a first pass, then the whole backward again), of a loss
    through the model and through a leaf outside it (a learnable scale). Returns the gradients
    made, and what one backward should make."""
    with ddpkit.Runtime("ddp", device="cpu", seed=0) as rt:
        bare = Checkpointed() if checkpointed else nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        model = rt.setup(bare)
        scale = torch.full((), 2.0, requires_grad=True)
        x = (torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 + rt.rank).requires_grad_(checkpointed)
        loss = (model(x) * scale).pow(2).mean()
        rt.backward(loss, weight=8 if weight else None)
        rebuilt = rt.ddp._has_rebuilt_buckets
        ref = ((bare.plain(x) if checkpointed else bare(x)) * scale).pow(2).mean()
        expected = torch.autograd.grad(ref, [scale, *bare.parameters()])
        averaged = [rt.all_reduce(g.clone()) / rt.world_size for g in expected[1:]]
        if weight:  # the weighted sum's gradients, until step() rescales them
            expected = tuple(g * 8 for g in expected)
            averaged = [g * 8 for g in averaged]
        return {
            "rebuilt": rebuilt,
            "scale": (scale.grad, expected[0]),
            "params": ([p.grad for p in bare.parameters()], averaged),
        }


def first_step_by_hand() -> dict:
    """3 ranks: the loop's first step calls `loss.backward()` itself, the next ones
    `rt.backward`; DDP has laid out its buckets by then, and every step's gradients must be
    the ranks' mean. Returns the second step's gradients and the weights after it."""
    with ddpkit.Runtime("ddp", device="cpu", seed=0) as rt:
        model, opt = rt.setup(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + rt.rank + step
            loss = model(x).pow(2).mean()
            if step == 0:
                loss.backward()
            else:
                rt.backward(loss)
                grads = [p.grad.clone() for p in model.parameters()]
            rt.step(opt)
        return {"grads": grads, "weights": [p.detach().clone() for p in model.parameters()]}


def model_kept_after_close() -> bool:
    """3 ranks (DDP's buckets left unsettled: no backward ran): whether the Runtime, closed,
    still keeps the model alive."""
    import gc
    import weakref

    with ddpkit.Runtime("ddp", device="cpu") as rt:
        model = rt.setup(nn.Linear(2, 1))
        ref = weakref.ref(rt.unwrap(model))
    del model
    gc.collect()
    return ref() is not None


class NormedCheckpointed(nn.Module):
    """A linear layer and a BatchNorm under reentrant activation checkpointing, then a head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True).relu())


def first_step_around(case: str) -> dict:
    """3 ranks, one step of what surrounds a first reducing backward: 'no_grad' (rank 0 runs a
    forward under no_grad between the training forward and its backward), 'batchnorm' (a
    BatchNorm that checkpointing recomputes in the backward), 'second_ddp' (the loss also goes
    through a head wrapped in torch's own DDP). Returns what every rank must agree on."""
    with ddpkit.Runtime("ddp", device="cpu", seed=0) as rt:
        bare = NormedCheckpointed() if case == "batchnorm" else nn.Linear(4, 3)
        model = rt.setup(bare)
        head = nn.parallel.DistributedDataParallel(nn.Linear(3, 2)) if case == "second_ddp" else None
        x = (torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10 + rt.rank).requires_grad_(True)
        out = model(x)
        if case == "no_grad" and rt.rank == 0:
            with torch.no_grad():
                model(x)
        out = head(out) if head is not None else out
        rt.backward(out.pow(2).mean())
        grads = [p.grad.clone() for p in (*bare.parameters(), *(head.parameters() if head else ()))]
        return {
            "grads": grads,
            "buffers": [b.clone() for b in bare.buffers()],
            "rebuilt": rt.ddp._has_rebuilt_buckets,
        }


def compiled_steps() -> list[torch.Tensor]:
    """3 ranks, torch.compile (inductor) inside DDP, two steps of two micro-batches: the
    weights after them (inductor's compiled backward refuses a retained graph when it donates
    buffers: nothing runs the first backward twice under compile)."""
    with ddpkit.Runtime("ddp", device="cpu", seed=0, compile=True) as rt:
        model = rt.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            for micro in range(2):
                x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + rt.rank + step + micro
                if micro == 0:
                    with rt.no_sync(model):
                        rt.backward(model(x).pow(2).mean())
                else:
                    rt.backward(model(x).pow(2).mean())
            rt.step(opt)
        return [p.detach().clone() for p in rt.unwrap(model).parameters()]


class Dropping(nn.Module):
    """Dropout twice: an nn.Dropout module (setup() replaces it) and ddpkit.dropout called in the
    forward (the functional form), the second at one site called twice."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.a, self.drop, self.b = nn.Linear(6, 16), nn.Dropout(p), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.a(x).relu())
        invariant = isinstance(self.drop, ddpkit.Dropout)  # (setup() replaced it)
        for _ in range(2):
            h = ddpkit.dropout(h, self.p, self.training) if invariant else F.dropout(h, self.p, self.training)
        return self.b(h)


def dropout_loop(p: float = 0.3, invariant: bool = True, micro: int | None = None, epochs: int = 3) -> torch.Tensor:
    """Regression with dropout in global batches of 10 (an uneven last one: 34 samples), in
    micro-batches of `micro`: the weights at the end."""
    with ddpkit.Runtime(device="cpu", seed=5, invariant_dropout=invariant) as rt:
        model = rt.build(lambda: Dropping(p))
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(34, 6, generator=g), torch.randn(34, 1, generator=g))
        loader = rt.loader(data, batch_size=10, micro_batch_size=micro)
        for _ in range(epochs):
            for x, y in loader:
                rt.backward(F.mse_loss(model(x), y))
                rt.step(opt)
        return params(model)
