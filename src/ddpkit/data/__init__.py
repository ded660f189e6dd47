"""Data: the dataset catalogue and its files, images and augmentation, the samplers that make
a run independent of the number of processes, and the distributed loader.

- `datasets`: the catalogue (digits, synthetic, toy, mnist, fashion-mnist, cifar10, text), shapes,
  loading; `readers` (the file formats) and `download` (where files live, fetching them);
- `text`: `TextSet`, byte sequences of varying length for the language model;
- `images`: `ImageSet` and `Augment` (batched augmentation keyed by sample position);
- `samplers`: `GlobalBatchSampler` (world-size-invariant global batches) and `ShardSampler`
  (exact evaluation);
- `loader`: `DistributedLoader` (resident on the device, or through a DataLoader);
- `stream`: `StreamLoader`, an IterableDataset read as one global stream on any world size.
"""

from __future__ import annotations

from .datasets import (
    CATALOGUE,
    DATASETS,
    FILE_DATASETS,
    NORMALIZATION,
    TEXT_DATASETS,
    Entry,
    Request,
    Splits,
    check_applies,
    check_pairing,
    digits,
    load,
    prepare,
    register,
    shape_of,
    synthetic,
    synthetic_bytes,
    toy,
    train_size,
)
from .images import Augment, ImageSet, augment_keys
from .loader import DistributedLoader, Resident, eval_loader, fits_on, move, train_loader
from .samplers import GlobalBatchSampler, MicroBatch, ShardSampler, check_global_batch, share
from .stream import StreamLoader, stream_loader
from .text import IGNORE, VOCAB, TextSet

__all__ = [
    "CATALOGUE",
    "DATASETS",
    "FILE_DATASETS",
    "IGNORE",
    "NORMALIZATION",
    "TEXT_DATASETS",
    "VOCAB",
    "Augment",
    "DistributedLoader",
    "Entry",
    "GlobalBatchSampler",
    "ImageSet",
    "MicroBatch",
    "Request",
    "Resident",
    "ShardSampler",
    "Splits",
    "check_applies",
    "check_pairing",
    "StreamLoader",
    "TextSet",
    "augment_keys",
    "check_global_batch",
    "digits",
    "eval_loader",
    "fits_on",
    "load",
    "move",
    "prepare",
    "register",
    "shape_of",
    "share",
    "stream_loader",
    "synthetic",
    "synthetic_bytes",
    "toy",
    "train_loader",
    "train_size",
]
