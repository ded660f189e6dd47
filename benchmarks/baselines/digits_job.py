"""The job every contender of `python -m benchmarks startup` runs, without ddpkit: scikit-learn's 8x8
digits (1438 train / 359 test, the split `ddpkit train` uses), the default small CNN, global
batch 64, SGD with Nesterov momentum 0.9, lr 0.05, weight decay 5e-4, cosine decay per step,
10 epochs, the whole test set evaluated after every epoch.

The CSV that scikit-learn bundles is read directly, as ddpkit does: `sklearn.datasets` would
import SciPy (over a second), which is not what the launchers are compared on.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

EPOCHS = int(os.environ.get("DIGITS_EPOCHS", "10"))
GLOBAL_BATCH = 64
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
TEST_SIZE = 359
SEED = 0


def load_digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): images standardized with the training set's mean and deviation."""
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    order = np.random.default_rng(SEED).permutation(len(table))
    test_idx, train_idx = order[:TEST_SIZE], order[TEST_SIZE:]
    x = torch.from_numpy(table[:, :64]).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, 64].astype(np.int64))
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def small_cnn() -> nn.Module:
    """ddpkit's default `cnn` for 1x8x8 inputs and 10 classes, layer for layer."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64 * 16, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)


def cosine(opt: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total_steps)))


@torch.no_grad()
def accuracy(model: nn.Module, test: TensorDataset) -> float:
    """Accuracy on the whole test set (359 samples: one batch)."""
    model.eval()
    x, y = test.tensors
    correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


class StepClock:
    """Rank 0's step times, taken as ddpkit's StepTimer takes them: from the end of one
    optimizer step (or the start of the epoch's loop) to the end of the next, so the data's
    fetch counts; a step whose input shape was not seen before is a warm-up step, left out.
    One clock read per step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.seen: set[tuple[int, ...]] = set()
        self.last = 0.0

    def start(self) -> None:
        self.last = time.perf_counter()

    def mark(self, shape: tuple[int, ...]) -> None:
        now = time.perf_counter()
        if shape in self.seen:
            self.seconds.append(now - self.last)
        self.seen.add(shape)
        self.last = now

    def line(self) -> str:
        """What the startup benchmark reads: the steady steps' median and mean, in ms."""
        ms = [s * 1e3 for s in self.seconds] or [float("nan")]
        return f"step ms p50 {statistics.median(ms):.4f} mean {statistics.fmean(ms):.4f} n {len(self.seconds)}"
