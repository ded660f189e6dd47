"""Exact evaluation: every sample of the test set counted once, whatever the world size.

Each rank evaluates its `ShardSampler` share (no padding, no repeated samples), summing on the
device, and one all-reduce at the end adds the ranks' sums. Under fsdp every forward all-gathers, so a
rank with one batch fewer than rank 0 runs one forward on an empty batch (`lockstep`).

`evaluate` measures any model whose batches are (input, target) pairs, and returns on every rank:

- `accuracy` (top-1, the share of target elements equal to the output's argmax over dimension
  1) only for classification: integer targets and outputs shaped like them with the classes
  at dimension 1, in every batch; left out otherwise (regression's float targets, a language
  model's (B, T, V) logits);
- `loss`, the mean of `loss_fn(output, target)` (a batch mean) weighted by the batch's target
  elements: with a `loss_fn`, or cross-entropy for classification; left out for other models
  without a `loss_fn`;
- `samples`, the dataset's samples (the targets' first dimension, summed);
- each of `metrics` (name -> fn(output, target) giving one value per sample, shape (n,)): its
  mean over all samples, from a float64 sum of its values per rank;
- `outputs` with an `outputs` function (output, target) -> per-sample values: those values of
  every sample, once each and in dataset order (`ddpkit.runtime.gather`), for metrics that are no mean
  over samples (AUC, BLEU, ...).

`evaluate_tokens` measures a language model (loss per token, perplexity, next-token accuracy),
counting every real token of the test set once and none of the padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core import checks, dist
from ..core.precision import Precision, outputs_to_fp32
from ..data import IGNORE, DistributedLoader, ShardSampler
from ..errors import UsageError
from ..strategy import eval_view, lockstep, stage_of
from .gather import Collector, gather
from .gather import samples as samples_in

# What one batch adds to the sums: (output, target) -> numbers (tensors on the device, or ints).
Measure = Callable[[Any, Any], tuple[Any, ...]]
# A metric: (output, target) -> one value per sample of the batch, shape (n,).
Metric = Callable[[Any, Any], torch.Tensor]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DistributedLoader,
    precision: Precision,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    metrics: Mapping[str, Metric] | None = None,
    outputs: Callable[[Any, Any], Any] | None = None,
    keys: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """`model` over all of `loader`'s dataset: accuracy (classification only), loss, samples,
    each of `metrics` and the gathered `outputs` (see the module's docstring). `keys`: the
    names of the input and the target in batches that are mappings (see `_pair`)."""
    metrics = dict(metrics or {})
    if RESULT_KEYS.intersection(metrics):
        raise UsageError(f"evaluate: the metric names {sorted(RESULT_KEYS)} are taken by the results")
    seen = Collector()

    def measure(out: Any, y: Any) -> tuple[Any, ...]:
        if outputs is not None:
            seen.add(_per_sample_outputs(outputs(out, y), len(y)))
        own = (_metric_sum(name, fn(out, y), len(y)) for name, fn in metrics.items())
        return (*_batch_sums(out, y, loss_fn), *own)

    sums = _sums(model, loader, precision, measure, 5 + len(metrics), keys)
    result = _summary(*sums[:5], with_loss=loss_fn is not None)
    result.update({name: total / max(1, result["samples"]) for name, total in zip(metrics, sums[5:])})
    if outputs is not None:
        result["outputs"] = gather(seen, loader.device, loader.group)
    return result


RESULT_KEYS = frozenset({"accuracy", "loss", "samples", "outputs"})


def is_classification(out: Any, y: Any) -> bool:
    """Whether (output, target) is a classifier's as cross-entropy reads it: integer class
    targets, and outputs shaped like them with a class dimension inserted at dimension 1. (A
    language model's (B, T, V) logits against (B, T) targets are not: their classes come last.)"""
    integer = not (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool)
    if not (integer and isinstance(out, torch.Tensor) and out.dim() == y.dim() + 1):
        return False
    return out.shape[:1] == y.shape[:1] and out.shape[2:] == y.shape[1:]


def _batch_sums(out: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> tuple[Any, ...]:
    """What a batch adds to the sums of: loss, correct, target elements, samples, and samples
    outside classification."""
    classes = is_classification(out, y)
    loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out, y) if classes else None
    # Python int counts: a device tensor built per batch would stall the GPU each time
    return (
        0 if loss is None else loss.double() * y.numel(),
        (out.argmax(1) == y).sum() if classes else 0,
        y.numel(),
        len(y),
        0 if classes else len(y),
    )


def _summary(loss: float, correct: float, count: float, samples: float, unfit: float, with_loss: bool) -> dict:
    total = int(count)
    result: dict[str, Any] = {} if unfit else {"accuracy": correct / max(1, total)}
    if with_loss or not unfit:
        result["loss"] = loss / max(1, total)
    result["samples"] = int(samples)
    return result


# The names a mapping batch's input and target are looked for under, in this order, when
# evaluate is not told them (`keys=`): the usual ones of custom collates and of Hugging Face.
INPUT_KEYS = ("input", "inputs", "x", "input_ids", "pixel_values", "image", "images")
TARGET_KEYS = ("target", "targets", "y", "labels", "label")


Keys = tuple[str | tuple[str, ...], str]  # (the input's name, or the names of the model's inputs; the target's)


class Inputs(dict):
    """A mapping batch's entries that the model takes as keyword arguments (`keys=((a, b), y)`)."""


def evaluation_keys(keys: Any) -> Keys | None:
    """`rt.evaluate(keys=...)` checked: (input name, target name), or ((input names...), target
    name); a UsageError otherwise."""
    if keys is None:
        return None
    if isinstance(keys, (tuple, list)) and len(keys) == 2 and isinstance(keys[1], str):
        first = keys[0]
        if isinstance(first, str):
            return first, keys[1]
        if isinstance(first, (tuple, list)) and first and all(isinstance(k, str) for k in first):
            return tuple(first), keys[1]
    raise UsageError(
        "rt.evaluate(keys=...): expected (input name, target name) or ((input names, ...), target name), "
        f"got {checks.shown(keys)}"
    )


def call(net: Any, x: Any) -> Any:
    """The model on an evaluation batch's input: `net(x)`, or `net(**x)` for several named inputs;
    through the pipeline for a pipeline stage (every stage gets the last one's output)."""
    stage = stage_of(net)
    if stage is not None and stage.pipeline is not None:
        if isinstance(x, Inputs):
            raise UsageError("evaluate under pp: one input tensor per batch, not named inputs")
        return stage.pipeline.forward(x)
    return net(**x) if isinstance(x, Inputs) else net(x)


def _pair(batch: Any, keys: Keys | None = None) -> tuple[Any, Any]:
    """An evaluation batch's (input, target): a pair, or a mapping's entries named `keys`
    (default: the first of INPUT_KEYS and of TARGET_KEYS it has); several input names give the
    entries as `Inputs`, for the model's keyword arguments."""
    if isinstance(batch, Mapping):
        names = keys or (_first(batch, INPUT_KEYS), _first(batch, TARGET_KEYS))
        if isinstance(names[0], tuple):
            missing = [name for name in (*names[0], names[1]) if name not in batch]
            if not missing:
                return Inputs((name, batch[name]) for name in names[0]), batch[names[1]]
        else:
            missing = [name for name in names if name is None or name not in batch]
        if missing:
            have = ", ".join(map(repr, list(batch)[:8]))
            said = "no " + " and no ".join(w for w, n in zip(("input", "target"), names) if n in missing) + " entry"
            if keys:
                said = f"no entry {missing[0]!r}"
            raise UsageError(
                f"evaluate: a batch that is a mapping ({have}) has {said}; name its input and target: "
                "rt.evaluate(..., keys=('input_ids', 'labels'))"
            )
        return batch[names[0]], batch[names[1]]
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        what = f"a {type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise UsageError(
            f"evaluate needs batches of (input, target), or mappings with both, not {what}; a pass of your own "
            "with rt.gather takes any batch"
        )
    return batch[0], batch[1]


def _first(batch: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in batch), None)


def _metric_sum(name: str, value: Any, n: int) -> torch.Tensor:
    """The float64 sum of metric `name`'s values for a batch of `n` samples."""
    if not isinstance(value, torch.Tensor):
        raise UsageError(
            f"evaluate: metric {name!r} returned {type(value).__name__}, not a tensor of one value per sample"
        )
    if value.shape != (n,):
        raise UsageError(
            f"evaluate: metric {name!r} returned shape {tuple(value.shape)} for a batch of {n} samples; "
            f"it must return one value per sample, shape ({n},)"
        )
    return value.double().sum()


def _per_sample_outputs(values: Any, n: int) -> Any:
    got = samples_in(values)
    if got != n:
        raise UsageError(f"evaluate: outputs() returned {got} values for a batch of {n} samples, not one per sample")
    return values


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


def _sums(
    model: nn.Module,
    loader: DistributedLoader,
    precision: Precision,
    measure: Measure,
    n: int,
    keys: tuple[str, str] | None = None,
) -> list[float]:
    """The `n` sums of `measure(output, target)` over every batch of every rank's share of
    `loader`: added up on the device, all-reduced once at the end."""
    if not isinstance(getattr(loader, "sampler", None), ShardSampler):
        raise UsageError(
            "evaluate needs a Dataset, a DataLoader or a loader from rt.eval_loader(), not a training loader"
        )
    # Below DDP there are no collectives, so ranks may run different numbers of batches.
    # DataParallel stays: it spreads the evaluation over the GPUs.
    net = eval_view(model)
    was_training = net.training
    net.eval()
    sums: list[Any] = [0] * n
    for batch in loader:
        x, y = _pair(batch, keys)
        with precision.autocast():
            out = outputs_to_fp32(call(net, x))
        sums = [total + value for total, value in zip(sums, measure(out, y))]
    if lockstep(net):  # ranks' batch counts differ by at most one; rank 0 has the most
        for _ in range(loader.sampler.most_batches() - len(loader)):
            with precision.autocast():
                call(net, _pair(loader.empty_batch(), keys)[0])
    net.train(was_training)
    sums_t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=loader.device) for v in sums])
    return dist.all_reduce(sums_t, group=loader.group).tolist()  # each sample on one data rank
