"""LeNet on MNIST, as a ddpkit.Runtime loop.

The tutorial defines a LeNet (two 5x5 convolutions of 20 and 50 channels, a 500-unit
layer), wraps it in DistributedDataParallel after init_process_group (so it runs only under
a launcher), and trains 10 epochs of plain SGD at lr 0.01, printing the running loss every
100 mini-batches on every rank. The same with ddpkit runs as it is, or on N processes:

    python examples/lenet_mnist.py --data-dir DATA
    ddpkit run --nproc 2 examples/lenet_mnist.py --data-dir DATA

Without the MNIST files (or with --synthetic) it trains on generated 1x28x28 images.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import data, models
from ddpkit.errors import UsageError


def load_data(rt: ddpkit.Runtime, args: argparse.Namespace) -> data.Splits:
    """MNIST from --data-dir, else generated images of the same shape."""
    if not args.synthetic:
        try:
            return data.load("mnist", data_dir=args.data_dir)
        except (UsageError, ValueError, OSError) as err:
            rt.print(f"MNIST not available ({err}); using synthetic 1x28x28 data")
    return data.synthetic((1, 28, 28), args.size, 10, seed=args.seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="where the mnist folder is (default: ddpkit's data root)")
    p.add_argument("--synthetic", action="store_true", help="generated data (the default when the files are missing)")
    p.add_argument("--size", type=int, default=4096, help="synthetic training samples")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch over all processes")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--log-every", type=int, default=100, help="print the mean loss every N optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--save", metavar="FILE.pt", help="write the trained model there")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with ddpkit.Runtime(seed=args.seed, device=args.device) as rt:
        splits = load_data(rt, args)
        model = models.build("lenet", splits.in_shape, splits.num_classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        model, optimizer = rt.setup(model, optimizer)
        for epoch in range(args.epochs):
            running, steps = torch.zeros((), device=rt.device), 0
            for x, y in rt.loader(splits.train, batch_size=args.batch_size):
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                running += loss.detach()
                if rt.step(optimizer):
                    steps += 1
                    if steps % args.log_every == 0:
                        # Every rank's running loss, averaged: one line, not one per rank.
                        rt.print(
                            f"[{epoch + 1}, {steps:5d}] loss: {rt.all_reduce(running, 'mean').item() / args.log_every:.3f}"
                        )
                        running.zero_()
            ev = rt.evaluate(model, splits.test)
            rt.print(f"epoch {epoch + 1}/{args.epochs}: test loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.4f}")
        if args.save:
            rt.save(args.save, model=model)
        rt.print("Finished Training")


if __name__ == "__main__":
    main()
