"""The Runtime's loaders: a Dataset, a DataLoader the user built, or a stream, read into
ddpkit's terms (`data.adopt`) and cut for this rank: its share of every global batch for
training, exactly one rank per sample for evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..data import DistributedLoader, StreamLoader, eval_loader, stream_loader, train_loader
from ..data.adopt import source
from ..errors import UsageError, usage_errors


@dataclass(frozen=True)
class Place:
    """Where this rank's batches go and how they are cut: what every loader of a Runtime shares.
    `world_size` and `rank` are the data ranks' (see ddpkit.strategy.mesh): the ranks of one
    tensor-parallel group read the same batches."""

    world_size: int
    rank: int
    device: torch.device
    local_world_size: int
    channels_last: bool
    lockstep: bool  # the strategy's: as many micro-batches on every rank (fsdp)
    group: Any = None  # the data ranks' process group (None: every rank reads other samples)

    def common(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "device": self.device,
            "channels_last": self.channels_last,
        }


def training(
    place: Place,
    data: Any,
    batch_size: int | None,
    shuffle: bool | None,
    drop_last: bool | None,
    seed: int | None,
    num_workers: int | None,
    micro_batch_size: int | None,
    resident: bool | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    default_seed: int,
) -> DistributedLoader | StreamLoader:
    """The training loader of `data` (see Runtime.loader); `seed` None is `default_seed`."""
    src = source(data, batch_size, shuffle, drop_last, collate_fn)
    if isinstance(src.dataset, IterableDataset):  # one stream, read whole by every rank
        workers = num_workers if num_workers is not None else src.options.get("num_workers")
        with usage_errors():  # the options that do not apply to a stream are refused by stream_loader
            return stream_loader(
                src.dataset,
                src.batch_size,
                **place.common(),
                drop_last=src.drop_last,
                micro_batch_size=micro_batch_size,
                lockstep=place.lockstep,
                collate_fn=src.collate_fn,
                shuffle=src.shuffle,
                seed=seed,
                num_workers=workers or None,
                resident=resident,
            )
    with usage_errors():  # torch's own refusals (num_workers=-1, ...) are bad input too
        loader = train_loader(
            src.dataset,
            src.batch_size,
            **place.common(),
            shuffle=True if src.shuffle is None else src.shuffle,
            seed=seed if seed is not None else default_seed,
            drop_last=src.drop_last,
            micro_batch_size=micro_batch_size,
            num_workers=num_workers,
            local_world_size=place.local_world_size,
            resident=resident,
            lockstep=place.lockstep,
            collate_fn=src.collate_fn,
            dataloader=src.options,
        )
    loader.group = place.group
    return loader


def evaluation(
    place: Place,
    data: Any,
    batch_size: int | None,
    num_workers: int | None,
    resident: bool | None,
    collate_fn: Callable[[list[Any]], Any] | None,
) -> DistributedLoader:
    """The evaluation loader of `data` (see Runtime.eval_loader)."""
    default = None if isinstance(data, DataLoader) else 512
    src = source(data, default if batch_size is None else batch_size, False, False, collate_fn)
    if isinstance(src.dataset, IterableDataset):
        raise UsageError(
            "evaluation reads a map-style test set (each sample once, split over the ranks by index); "
            "a stream has no length to split: evaluate a map-style Dataset"
        )
    with usage_errors():
        loader = eval_loader(
            src.dataset,
            src.batch_size,
            **place.common(),
            num_workers=num_workers,
            local_world_size=place.local_world_size,
            resident=resident,
            collate_fn=src.collate_fn,
            dataloader=src.options,
        )
    loader.group = place.group
    return loader
