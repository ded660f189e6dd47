"""Exact evaluation: every sample of the test set counted once, whatever the world size.

Each rank evaluates its `ShardSampler` share (no padding, no repeated samples), summing on the
device, and one all-reduce at the end adds the ranks' sums. Under fsdp every forward all-gathers, so a
rank with one batch fewer than rank 0 runs one forward on an empty batch (`lockstep`).

`evaluate` measures a classifier (accuracy and loss per sample); `evaluate_tokens` a language
model (loss per token, perplexity, next-token accuracy), counting every real token of the test
set once and none of the padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dist
from .data import IGNORE, DistributedLoader, ShardSampler
from .precision import Precision, outputs_to_fp32
from .strategy import eval_view
from .strategy.fsdp import is_sharded

# What one batch adds to the sums: (output, target) -> numbers (tensors on the device, or ints).
Measure = Callable[[Any, Any], tuple[Any, ...]]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DistributedLoader,
    precision: Precision,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Accuracy and mean per-sample loss of a classifier over all of `loader`'s dataset.

    `loss_fn(output, target)` must return a batch mean (default: cross-entropy)."""

    def measure(out: Any, y: Any) -> tuple[Any, ...]:
        loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out, y)
        # a Python int count: a device tensor built per batch would stall the GPU each time
        return loss.double() * y.numel(), (out.argmax(1) == y).sum(), y.numel()

    loss, correct, count = _sums(model, loader, precision, measure, 3)
    total = int(count)
    return {"accuracy": correct / max(1, total), "loss": loss / max(1, total), "samples": total}


@torch.no_grad()
def evaluate_tokens(model: nn.Module, loader: DistributedLoader, precision: Precision) -> dict[str, float]:
    """A language model over all of `loader`'s dataset, per token: mean cross-entropy of the
    next token (`loss`, in nats), `perplexity` (exp of it), top-1 `accuracy`, and the
    `tokens` and `samples` (sequences) counted. The model maps (B, T) to logits (B, T, V);
    targets equal to `ddpkit.data.IGNORE` (padding) count nowhere."""

    def measure(out: Any, y: Any) -> tuple[Any, ...]:
        real = y != IGNORE
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        return loss.double(), ((out.argmax(-1) == y) & real).sum(), real.sum(), len(y)

    loss, correct, tokens, samples = _sums(model, loader, precision, measure, 4)
    mean = loss / max(1, tokens)
    return {
        "loss": mean,
        "perplexity": perplexity(mean),
        "accuracy": correct / max(1, tokens),
        "tokens": int(tokens),
        "samples": int(samples),
    }


def perplexity(loss: float) -> float:
    """exp(loss per token): the number of equally likely choices the model is as unsure as;
    infinite for a loss beyond what a float holds the exp of."""
    return math.inf if loss > 709 else math.exp(loss)


def _sums(model: nn.Module, loader: DistributedLoader, precision: Precision, measure: Measure, n: int) -> list[float]:
    """The `n` sums of `measure(output, target)` over every batch of every rank's share of
    `loader`: added up on the device, all-reduced once at the end."""
    if not isinstance(loader.sampler, ShardSampler):
        raise TypeError("evaluate() needs a Dataset or a loader from Runtime.eval_loader()")
    # Below DDP there are no collectives, so ranks may run different numbers of batches.
    # DataParallel stays: it spreads the evaluation over the GPUs.
    net = eval_view(model)
    was_training = net.training
    net.eval()
    sums: list[Any] = [0] * n
    for x, y in loader:
        with precision.autocast():
            out = outputs_to_fp32(net(x))
        sums = [total + value for total, value in zip(sums, measure(out, y))]
    if is_sharded(net):  # ranks' batch counts differ by at most one; rank 0 has the most
        for _ in range(loader.sampler.most_batches() - len(loader)):
            with precision.autocast():
                net(loader.empty_batch()[0])
    net.train(was_training)
    sums_t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=loader.device) for v in sums])
    return dist.all_reduce(sums_t).tolist()
