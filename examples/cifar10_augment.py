"""CIFAR-10 with random-crop + flip augmentation, as a ddpkit.Runtime loop.

The tutorial builds `transforms.Compose([RandomHorizontalFlip(), RandomCrop(32, padding=4),
ToTensor(), Normalize(...)])` and feeds a DataLoader. Here the images stay uint8 in an
ImageSet, which normalizes them per channel and augments each sample on the device from a
key derived from the run's seed: the same crops and flips on 1 process or 8.

    python examples/cifar10_augment.py --data-dir DATA
    ddpkit run --nproc 2 examples/cifar10_augment.py --data-dir DATA --model resnet18

Without the CIFAR-10 files (or with --synthetic) it trains on generated 3x32x32 uint8 images.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import data, models
from ddpkit.data import Augment, ImageSet
from ddpkit.errors import UsageError


def load_data(rt: ddpkit.Runtime, args: argparse.Namespace) -> data.Splits:
    """CIFAR-10 from --data-dir, else generated uint8 images of the same shape."""
    if not args.synthetic:
        try:
            return data.load("cifar10", data_dir=args.data_dir)
        except (UsageError, ValueError, OSError) as err:
            rt.print(f"CIFAR-10 not available ({err}); using synthetic 3x32x32 data")
    return data.synthetic((3, 32, 32), args.size, 10, seed=args.seed)


def with_augment(images: ImageSet, crop_padding: int) -> ImageSet:
    """The same images and normalization, read through crop (zero-pad, crop back) + flip."""
    return ImageSet(
        images.images, images.labels, images.mean, images.std, augment=Augment(crop_padding=crop_padding, flip=True)
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="where the cifar10 folder is (default: ddpkit's data root)")
    p.add_argument("--synthetic", action="store_true", help="generated data (the default when the files are missing)")
    p.add_argument("--size", type=int, default=2048, help="synthetic training samples")
    p.add_argument("--model", default="cnn", help="a built-in model (cnn, resnet18, fast-cifar, ...)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch over all processes")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--crop-padding", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--save", metavar="FILE.pt", help="write a checkpoint (model, optimizer) at the end")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with ddpkit.Runtime(seed=args.seed, device=args.device) as rt:
        splits = load_data(rt, args)
        train_set = with_augment(splits.train, args.crop_padding)  # the test set is never augmented
        model = models.build(args.model, splits.in_shape, splits.num_classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(train_set, batch_size=args.batch_size)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * loader.steps_per_epoch)
        for epoch in range(args.epochs):
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                if rt.step(optimizer):  # False between micro-batches of one global batch
                    scheduler.step()
            rt.print(
                f"epoch {epoch + 1}/{args.epochs}: test accuracy {rt.evaluate(model, splits.test)['accuracy']:.4f}"
            )
        if args.save:
            rt.save(args.save, model=model, optimizer=optimizer)
        rt.print(f"done: {args.model} on {len(train_set)} images, {rt.world_size} process(es)")


if __name__ == "__main__":
    main()
