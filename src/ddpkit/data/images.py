"""Images as stored, normalized and augmented per batch on their device.

Random augmentation (crop with padding, horizontal flip) is drawn per sample from a hash of
(seed, epoch, position of the sample in the epoch's global order), not from a random stream.
So it is the same on both data paths, on any number of processes, and after a resume
mid-epoch.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from ..core import checks

_M32 = 0xFFFFFFFF


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply rounds) of a Python int, or elementwise of an
    int64 tensor holding values below 2**32 (both give the same numbers). Both multipliers are
    below 2**31, so no product overflows int64 on any device."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x6C8E9CF5) & _M32
    return x ^ (x >> 16)


def augment_keys(seed: int, epoch: int, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sample from (seed, epoch, its position in the epoch's global order):
    what decides the sample's random crop and flip, wherever and whenever it is read."""
    base = _mix32((seed * 1_000_003 + epoch) & _M32)  # a Python int: no copy to the device per batch
    return _mix32(positions.to(torch.int64) ^ base)


@dataclass(frozen=True)
class Augment:
    """Random crop after zero-padding by `crop_padding` pixels (0: no crop), and a random
    horizontal flip: the standard CIFAR-10 training augmentation."""

    crop_padding: int = 0
    flip: bool = False

    NAMES = ("none", "crop", "flip", "crop-flip")

    @classmethod
    def parse(cls, name: str, crop_padding: int = 4) -> Augment | None:
        checks.choice("--augment", name, cls.NAMES)
        if name == "none":
            return None
        return cls(crop_padding if "crop" in name else 0, "flip" in name)

    def __call__(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Augment a batch (B, C, H, W) on its device; sample i uses keys[i] only."""
        if self.crop_padding:
            p = self.crop_padding
            b, _, h, w = x.shape
            padded = torch.nn.functional.pad(x, (p, p, p, p))
            span = 2 * p + 1
            dx, dy = (keys >> 1) % span, (keys >> 12) % span
            rows = dy[:, None] + torch.arange(h, device=x.device)  # (B, H)
            cols = dx[:, None] + torch.arange(w, device=x.device)  # (B, W)
            picked = padded[torch.arange(b, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
            x = picked.permute(0, 3, 1, 2)  # advanced indexing put the channels last
        if self.flip:
            x = torch.where((keys & 1).bool()[:, None, None, None], x.flip(3), x)
        return x


def selectable(t: torch.Tensor) -> bool:
    """Whether `t.index_select(0, i)` gives exactly what `t[i]` gives for a 1-D index `i` (the
    same values, dtype and memory layout), without Python's indexing machinery: `t` has rows,
    is laid out contiguously (index_select's result always is, where `t[i]` keeps a permuted
    layout such as channels_last), and has an index_select kernel for its dtype and shape (a 1-D
    tensor of uint16, uint32 or uint64 has none). Asked once per tensor, not per batch."""
    if t.dim() == 0 or t.layout != torch.strided or not t.is_contiguous():
        return False
    try:
        t.index_select(0, torch.zeros(min(1, len(t)), dtype=torch.long, device=t.device))
    except RuntimeError:  # (NotImplementedError is one)
        return False
    return True


class ImageSet(Dataset):
    """Images as stored (uint8, or float), normalized per channel when read, and augmented
    when an `augment` is given and the sampler passes keys.

    `dataset[i]` is sample i normalized; `dataset[(i, key)]` is it augmented by `key` (what
    the DataLoader path's batch sampler asks for). `batch(indices, keys)` does the same for a
    whole batch at once on the device the images are on (the resident path).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Any, std: Any, augment: Augment | None = None):
        if images.dim() != 4:
            raise ValueError(f"ImageSet wants images shaped (N, C, H, W), got {tuple(images.shape)}")
        self.images, self.labels, self.augment = images, labels, augment
        channels = images.shape[1]
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, channels, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1).expand(channels).reshape(1, channels, 1, 1)
        self._resident: dict[str, ImageSet] = {}
        self._select = selectable(images) and selectable(labels)  # (see _batch)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        index, aug_key = key if isinstance(key, tuple) else (key, None)
        device = self.images.device
        keys = None if aug_key is None else torch.tensor([aug_key], dtype=torch.int64, device=device)
        row = operator.index(index)
        row = row + len(self) if row < 0 else row  # counted from the end, as t[index] counts it
        x, _ = self._batch(torch.tensor([row], device=device), keys)
        return x[0], self.labels[index]

    def batch(self, indices: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(indices, keys)

    def _batch(self, indices: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._select:  # the same rows as images[indices], without Python's indexing machinery
            x, labels = self.images.index_select(0, indices), self.labels.index_select(0, indices)
        else:
            x, labels = self.images[indices], self.labels[indices]
        if self.augment is not None and keys is not None:
            x = self.augment(x, keys)
        x = (x.float() - self.mean) / self.std
        return x.contiguous(), labels

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole set normalized, without augmentation: (images, labels)."""
        return self._batch(torch.arange(len(self), device=self.images.device), None)

    def nbytes(self) -> int:
        return self.images.numel() * self.images.element_size() + self.labels.numel() * self.labels.element_size()

    def to(self, device: torch.device) -> ImageSet:
        """A copy living on `device` (made once, then reused)."""
        if self.images.device == device:
            return self
        key = str(device)
        if key not in self._resident:
            self._resident[key] = ImageSet(
                self.images.to(device), self.labels.to(device), self.mean.to(device), self.std.to(device), self.augment
            )
        return self._resident[key]
