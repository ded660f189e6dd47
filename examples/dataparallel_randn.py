"""The DataParallel tutorial, as DistributedDataParallel with ddpkit.Runtime.

The tutorial wraps a two-convolution network (3 -> 64 -> 128 channels, 3x3) in
nn.DataParallel and trains it for 10 epochs on 100 random 3x32x32 images with random labels
(one full batch per epoch, SGD lr 0.001). Its network had no classifier; ddpkit's
`simple-cnn` is the same two convolutions with a ReLU between them and a pooled linear head.
Here each process holds a replica and takes its share of the batch of 100:

    python examples/dataparallel_randn.py
    ddpkit run --nproc 2 examples/dataparallel_randn.py     # the same losses
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import models


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--size", type=int, default=100, help="random samples (all of them form one global batch)")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--synthetic", action="store_true", help="accepted for symmetry: the data is always random")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A generator of its own: every rank draws the same "dataset", whatever else uses the RNG.
    g = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(
        torch.randn(args.size, 3, 32, 32, generator=g), torch.randint(0, 10, (args.size,), generator=g)
    )
    with ddpkit.Runtime(seed=args.seed, device=args.device) as rt:
        model = models.build("simple-cnn", (3, 32, 32), 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        model, optimizer = rt.setup(model, optimizer)
        for epoch in range(args.epochs):
            loss_sum = torch.zeros((), device=rt.device)
            for x, y in rt.loader(data, batch_size=args.size):  # the whole set is one global batch
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                rt.step(optimizer)
                loss_sum += loss.detach() * len(y)
            # Each rank saw its share: sum the per-sample losses over ranks for the batch's mean.
            rt.print(f"epoch {epoch}, loss {rt.all_reduce(loss_sum).item() / args.size:.4f}")
        rt.print(
            f"finished: {args.epochs} epochs on {rt.world_size} process(es), "
            f"final loss {rt.evaluate(model, data)['loss']:.4f}"
        )


if __name__ == "__main__":
    main()
