"""d2l's multi-GPU ResNet-18 on Fashion-MNIST, as a ddpkit.Runtime loop.

d2l's `train(net, num_gpus, batch_size, lr)` wraps the net in nn.DataParallel, trains it
with plain SGD for 10 epochs and prints test accuracy and seconds per epoch; it is called
as train(net, 1, 256, 0.1) and train(net, 2, 512, 0.2). Here the same function runs in
every process: `batch_size` is the GLOBAL batch, so 256 / 0.1 gives the same model on one
device or on eight; pass --batch-size 512 --lr 0.2 to reproduce the chapter's second call.

    python examples/d2l_resnet18_fashion_mnist.py --data-dir DATA
    ddpkit run --nproc 2 examples/d2l_resnet18_fashion_mnist.py --data-dir DATA

Without the Fashion-MNIST files (or with --synthetic) it trains on small generated 1x28x28
images instead, so the script runs anywhere.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import data, models
from ddpkit.errors import UsageError


def load_data(rt: ddpkit.Runtime, args: argparse.Namespace) -> data.Splits:
    """Fashion-MNIST from --data-dir, else generated images of the same shape."""
    if not args.synthetic:
        try:
            return data.load("fashion-mnist", data_dir=args.data_dir)
        except (UsageError, ValueError, OSError) as err:
            rt.print(f"Fashion-MNIST not available ({err}); using synthetic 1x28x28 data")
    return data.synthetic((1, 28, 28), args.size, 10, seed=args.seed)


def init_weights(m: nn.Module) -> None:
    # d2l's initialization: small normal weights for linear and convolution layers.
    if type(m) in (nn.Linear, nn.Conv2d):
        nn.init.normal_(m.weight, std=0.01)


def train(rt: ddpkit.Runtime, splits: data.Splits, batch_size: int, lr: float, epochs: int) -> float:
    net = models.build("resnet18", splits.in_shape, splits.num_classes)  # d2l's small-image ResNet-18
    net.apply(init_weights)
    trainer = torch.optim.SGD(net.parameters(), lr=lr)
    net, trainer = rt.setup(net, trainer)
    seconds = []
    for epoch in range(epochs):
        net.train()
        start = time.perf_counter()
        for x, y in rt.loader(splits.train, batch_size=batch_size):
            rt.backward(F.cross_entropy(net(x), y))
            rt.step(trainer)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        accuracy = rt.evaluate(net, splits.test)["accuracy"]
        rt.print(f"epoch {epoch + 1}/{epochs}: test acc {accuracy:.3f}")
    rt.print(
        f"test acc: {accuracy:.2f}, {sum(seconds) / len(seconds):.1f} sec/epoch on {rt.world_size} x {rt.device.type}"
    )
    return accuracy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="where the fashion-mnist folder is (default: ddpkit's data root)")
    p.add_argument("--synthetic", action="store_true", help="generated data (the default when the files are missing)")
    p.add_argument("--size", type=int, default=2048, help="synthetic training samples")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch over all processes")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with ddpkit.Runtime(seed=args.seed, device=args.device) as rt:
        train(rt, load_data(rt, args), args.batch_size, args.lr, args.epochs)


if __name__ == "__main__":
    main()
