"""The DDP tutorial's toy problem, on ddpkit.Runtime.

The tutorial (Raschka's style: mp.spawn, init_process_group, DistributedSampler, a
NeuralNetwork of 2 -> 30 -> 20 -> 2 units, SGD lr 0.5, batch_size=2 per GPU, 3 epochs)
classifies five 2-D points into two classes and checks two test points. Each rank printed
its own accuracy; here the launcher starts the processes, the loader shards the GLOBAL batch
(4 = 2 per rank on 2 ranks) and the accuracies are computed over all points and printed once:

    python examples/toy_ddp.py                      # one process
    ddpkit run --nproc 2 examples/toy_ddp.py        # two, same result
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class NeuralNetwork(nn.Module):
    def __init__(self, num_inputs: int, num_outputs: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(num_inputs, 30),
            nn.ReLU(),
            nn.Linear(30, 20),
            nn.ReLU(),
            nn.Linear(20, num_outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def toy_data() -> tuple[TensorDataset, TensorDataset]:
    """Five training points and two test points; class 0 upper left, class 1 lower right."""
    x_train = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
    y_train = torch.tensor([0, 0, 0, 1, 1])
    x_test = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
    y_test = torch.tensor([0, 1])
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="GLOBAL batch (the tutorial: 2 per rank x 2 ranks)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--synthetic", action="store_true", help="accepted for symmetry: the data is always built in")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    train_set, test_set = toy_data()
    with ddpkit.Runtime(seed=args.seed, device=args.device) as rt:
        model = NeuralNetwork(num_inputs=2, num_outputs=2)  # built from the seed: identical on every rank
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        model, optimizer = rt.setup(model, optimizer)
        for epoch in range(args.epochs):
            for x, y in rt.loader(train_set, batch_size=args.batch_size):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(optimizer)
            # The loss over all five points, not one rank's share: evaluate() all-reduces.
            rt.print(f"epoch {epoch + 1}/{args.epochs} train loss {rt.evaluate(model, train_set)['loss']:.4f}")
        rt.print(f"train accuracy {rt.evaluate(model, train_set)['accuracy']}")
        rt.print(f"test accuracy {rt.evaluate(model, test_set)['accuracy']}")


if __name__ == "__main__":
    main()
