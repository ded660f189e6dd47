"""The built-in networks, each built from the dataset's input shape and number of classes."""

from __future__ import annotations

import math
from typing import Callable

from torch import nn

Builder = Callable[[tuple[int, ...], int], nn.Module]


def small_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The default: two 3x3 convolutions, max-pool, then a 4x4 grid of features into a small
    MLP head. Keeping the 4x4 grid (not one global average) keeps where the strokes are, which
    is most of what an 8x8 digit is. Any image size >= 2x2; about 150k parameters. No
    BatchNorm, so its results do not depend on how the global batch is split over processes.
    """
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 16, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def simple_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The DataParallel tutorial's two convolutions (64 and 128 channels, 3x3), which had no
    classifier; given a ReLU between them and a pooled linear head so it can be trained."""
    return nn.Sequential(
        nn.Conv2d(in_shape[0], 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def lenet(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """LeNet-style: conv(20, 5x5) - pool - conv(50, 5x5) - pool - fc 500 - fc classes.

    Padding 2 keeps small inputs (8x8 digits) valid; on 28x28 the head sees 50x7x7.
    """
    c, h, w = in_shape
    return nn.Sequential(
        nn.Conv2d(c, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(50 * (h // 4) * (w // 4), 500), nn.ReLU(),
        nn.Linear(500, num_classes),
    )


def mlp(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The DDP tutorial's toy network: two hidden layers of 30 and 20 units."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(in_shape), 30), nn.ReLU(),
        nn.Linear(30, 20), nn.ReLU(),
        nn.Linear(20, num_classes),
    )


MODELS: dict[str, Builder] = {"cnn": small_cnn, "simple-cnn": simple_cnn, "lenet": lenet, "mlp": mlp}


def check(name: str, in_shape: tuple[int, ...]) -> None:
    """Raise ValueError if model `name` cannot take inputs of `in_shape` (C, H, W)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if name != "mlp" and len(in_shape) != 3:
        raise ValueError(f"model {name!r} needs images shaped C,H,W, got {in_shape}")
    smallest = {"lenet": 4, "cnn": 2}.get(name, 1)
    if name != "mlp" and min(in_shape[1:]) < smallest:
        raise ValueError(f"model {name!r} needs images of at least {smallest}x{smallest}, got {in_shape}")


def build(name: str, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    check(name, in_shape)
    return MODELS[name](in_shape, num_classes)
