"""One walk over nested batches and model outputs, shared by the loaders and the precision code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` with `fn` applied to every tensor inside (nested) lists, tuples, namedtuples and
    mappings, keeping the container types (dict subclasses such as HuggingFace's ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, o) for o in obj)
    if isinstance(obj, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except TypeError:
            return mapped
    return obj


def empty_like_batch(batch: Any) -> Any:
    """A batch of no samples shaped like `batch` (a collate's batch of one): tensors cut to no
    rows, and lists or tuples of plain per-sample values (strings, numbers) emptied, so that
    nothing in it counts as a sample; other containers kept."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: its fields
        return type(batch)(*(empty_like_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(v, (str, bytes, int, float)) for v in batch):
        return type(batch)()
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_like_batch(v) for v in batch)
    if isinstance(batch, Mapping):
        return {k: empty_like_batch(v) for k, v in batch.items()}
    return batch[:0] if isinstance(batch, torch.Tensor) else batch
