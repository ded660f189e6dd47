"""Exact evaluation: every sample of the test set counted once, whatever the world size.

Each rank evaluates its `ShardSampler` share (no padding, no repeated samples), summing on the
device, and one all-reduce at the end adds the ranks' sums. Under fsdp every forward all-gathers, so a
rank with one batch fewer than rank 0 runs one forward on an empty batch (`lockstep`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dist
from .data import DistributedLoader, ShardSampler
from .precision import Precision, outputs_to_fp32
from .strategy import eval_view
from .strategy.fsdp import is_sharded


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DistributedLoader,
    precision: Precision,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Accuracy and mean per-sample loss of a classifier over all of `loader`'s dataset.

    `loss_fn(output, target)` must return a batch mean (default: cross-entropy)."""
    if not isinstance(loader.sampler, ShardSampler):
        raise TypeError("evaluate() needs a Dataset or a loader from Runtime.eval_loader()")
    # Below DDP there are no collectives, so ranks may run different numbers of batches.
    # DataParallel stays: it spreads the evaluation over the GPUs.
    net = eval_view(model)
    was_training = net.training
    net.eval()
    device = loader.device
    correct = torch.zeros((), dtype=torch.float64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0  # a Python int: a device tensor built per batch would stall the GPU each time
    for x, y in loader:
        with precision.autocast():
            out = outputs_to_fp32(net(x))
        loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out, y)
        correct += (out.argmax(1) == y).sum()
        loss_sum += loss.double() * y.numel()
        count += y.numel()
    if is_sharded(net):  # ranks' batch counts differ by at most one; rank 0 has the most
        for _ in range(loader.sampler.most_batches() - len(loader)):
            with precision.autocast():
                net(loader.empty_batch()[0])
    net.train(was_training)
    sums = torch.stack([correct, loss_sum, torch.tensor(float(count), dtype=torch.float64, device=device)])
    dist.all_reduce(sums)
    total = int(sums[2].item())
    return {"accuracy": sums[0].item() / max(1, total), "loss": sums[1].item() / max(1, total), "samples": total}
