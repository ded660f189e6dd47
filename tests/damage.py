"""Damage to real checkpoint files, as a disk, a copy or a hand does it: flipped bytes inside a
tensor's record of a torch.save zip, and flipped or zeroed ranges of any file."""

from __future__ import annotations

import zipfile
from pathlib import Path


def tensor_bytes(path: Path) -> tuple[int, int]:
    """(offset, length) of the bytes of the largest record of the torch.save zip at `path`: a
    tensor's storage."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    data = path.read_bytes()
    at = info.header_offset
    name_len = int.from_bytes(data[at + 26 : at + 28], "little")
    extra_len = int.from_bytes(data[at + 28 : at + 30], "little")
    return at + 30 + name_len + extra_len, info.file_size


def flip(path: Path, offset: int, count: int = 16) -> None:
    """Invert `count` bytes of the file from `offset`."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def zero(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(count)
    path.write_bytes(bytes(data))


def flip_a_tensor(path: Path, count: int = 16) -> None:
    """Flip `count` bytes in the middle of the largest tensor a torch.save file holds."""
    start, length = tensor_bytes(path)
    flip(path, start + length // 2, count)
