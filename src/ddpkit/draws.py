"""Dropout whose masks do not depend on the number of processes.

torch's dropout draws each mask from the process's random stream. Split over N ranks, each
rank draws for its share of the batch from its own stream, so the masks (and the run) change
with N. Here a mask element is a hash of what identifies it in the run, never of where it ran:

    (seed, optimizer step, call site and its call number in the forward,
     the sample's position in the global batch, the element's index in the sample)

computed with integer tensor operations on the tensor's device: no Python loop, no
generator per sample, and no draw from torch's streams (which stay as they were). A
counter-based hash, as Philox is to CUDA's generator: the same key gives the same bits on
any rank, in any order, on any number of processes or micro-batches.

The Runtime keys the draws: its seed, the steps `rt.step()` has taken, and the position of
the current micro-batch from `rt.loader()`. `rt.setup` puts `Dropout` in place of the
model's `nn.Dropout`, `nn.Dropout1d`, `nn.Dropout2d` and `nn.Dropout3d` modules; `dropout`
is the functional form, for `F.dropout` calls in a forward of one's own. Without a Runtime (or
outside its loader's batches) each falls back to what it replaces: torch's draw, or keys
with the rank in them where the batch's place is unknown.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Dropout", "dropout"]

# The hash: two xorshift-multiply rounds on 32-bit lanes (int32 tensors wrap on multiply on
# every device; shifts are made logical by a mask). Multipliers are odd and below 2**31.
_M1, _M2 = 0x7FEB352D, 0x5BD1E995
_ROW, _ELEMENT = 0x2545F491, 0x61C88647
_U32 = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mix of an int32 tensor (logical shifts, wrapping multiplies)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def _mix_int(h: int) -> int:
    """`_mix` on a Python int in [0, 2**32) (the keys: computed once per call, on the host)."""
    h ^= h >> 16
    h = (h * _M1) & _U32
    h ^= h >> 15
    h = (h * _M2) & _U32
    return h ^ (h >> 16)


def _int32(h: int) -> int:
    """[0, 2**32) as the int32 with those bits."""
    return h - (1 << 32) if h >= 1 << 31 else h


def key(*parts: int) -> int:
    """One 32-bit key of non-negative integers (each folded in 32 bits at a time)."""
    h = 0x3243F6A8
    for part in parts:
        part &= (1 << 64) - 1  # (a negative seed as its two's complement)
        while True:
            h = _mix_int((h ^ (part & _U32)) + 0x9E3779B9 & _U32)
            part >>= 32
            if not part:
                break
    return h


def site_id(name: str) -> int:
    """A call site's number: the same in every process (crc32, not Python's salted hash)."""
    return zlib.crc32(name.encode())


def keep_mask(rows: torch.Tensor, per_row: int, keyed: int, p: float) -> tuple[torch.Tensor, float]:
    """Which elements to keep, shaped (len(rows), per_row), for the rows' positions `rows` (an
    int64 tensor on the device) under the call's key: each element a 16-bit uniform draw
    compared with p (p is so rounded to 1/65536), and the scale that keeps the mean, 1/(1-p)."""
    threshold = min(65536, round(p * 65536))
    row = _mix((rows.to(torch.int32) * _ROW) + _int32(keyed))
    half = (per_row + 1) // 2  # a 32-bit hash gives two 16-bit draws
    element = torch.arange(half, dtype=torch.int32, device=rows.device) * _ELEMENT
    draws = _mix(row[:, None] + element).view(torch.int16)[:, :per_row]  # little-endian lanes
    if threshold == 65536:  # (32768 is no int16: the comparison would wrap it)
        return torch.zeros(draws.shape, dtype=torch.bool, device=draws.device), 0.0
    keep = draws >= threshold - 32768  # the draw as an unsigned 16-bit number >= threshold
    kept = 1.0 - threshold / 65536
    return keep, (1.0 / kept if kept > 0 else 0.0)


@dataclass
class Source:
    """What keys the draws, read at each call: set by the Runtime's setup()."""

    seed: int
    step: Callable[[], int]  # optimizer steps taken
    micro: Callable[[], Any]  # the loader's current MicroBatch (its rows' place), or None
    rank: int
    forward: Callable[[], int]  # changes each time a loader hands out a micro-batch


_source: Source | None = None
_calls: dict[int, list[int]] = {}  # site -> [calls this forward, calls replayed in backward]
_calls_key: tuple[int, int, int] | None = None
_warned: set[str] = set()


def follow(source: Source | None) -> None:
    """Key the draws by `source` from now on (None: fall back to torch's dropout)."""
    global _source, _calls_key
    _source, _calls_key = source, None
    _calls.clear()


def _call_number(site: int) -> int:
    """This site's call number in the current micro-batch's forward. A forward replayed in the
    backward (activation checkpointing recomputes it there) gets the numbers the forward had."""
    global _calls_key
    src = _source
    now = (src.step(), id(src.micro()), src.forward())
    if now != _calls_key:
        _calls_key = now
        _calls.clear()
    counts = _calls.setdefault(site, [0, 0])
    if torch._C._current_graph_task_id() != -1 and counts[0]:  # recomputed in a backward
        number = counts[1] % counts[0]
        counts[1] += 1
        return number
    counts[0] += 1
    return counts[0] - 1


@torch.compiler.disable  # the keys live in Python: a compiled graph would bake one step's in
def _draw(x: torch.Tensor, p: float, site: str, channels: int | None) -> torch.Tensor:
    src = _source
    sid = site_id(site)
    number = _call_number(sid)
    micro = src.micro()
    dim = _batch_dim(x, micro)
    if dim is None:  # the batch's place is unknown: keys of this rank's own
        if micro is not None and site not in _warned:
            _warned.add(site)
            print(
                f"ddpkit: dropout at {site}: no dimension of its input {tuple(x.shape)} has the micro-batch's "
                f"{micro.size} samples; its masks depend on the rank (and so on the number of processes)",
                file=sys.stderr,
            )
        keyed, first = key(src.seed, src.step(), sid, number, 1, src.rank), 0
        moved = x if x.dim() else x.reshape(1)
    else:
        keyed = key(src.seed, src.step(), sid, number, 0)
        first = micro.start if micro is not None else 0
        moved = x.movedim(dim, 0) if dim else x
    rows = torch.arange(first, first + moved.shape[0], device=x.device)
    per_sample = moved[0].numel() if moved.shape[0] else 0
    shape = moved.shape if channels is None else (*moved.shape[:2], *[1] * (moved.dim() - 2))
    per_row = per_sample if channels is None else shape[1]
    keep, scale = keep_mask(rows, per_row, keyed, p)
    out = torch.where(keep.reshape(shape), moved * scale, moved.new_zeros(()))
    if dim is None:
        return out.reshape(x.shape)
    return out.movedim(0, dim) if dim else out


def _batch_dim(x: torch.Tensor, micro: Any) -> int | None:
    """Which dimension of `x` holds the samples of the current micro-batch: the first whose size
    is its number of samples (0 when there is no loader's micro-batch); None when none is."""
    if micro is None:
        return 0 if x.dim() >= 1 else None
    if x.dim() and x.shape[0] == micro.size:
        return 0
    return next((d for d in range(1, x.dim()) if x.shape[d] == micro.size), None)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, site: str | None = None) -> torch.Tensor:
    """`F.dropout(x, p, training)`, with a mask that does not depend on the number of processes
    (see the module's docstring): for dropout in a forward of your own.

    `site` names the call (default: the calling function and line, the same in every process);
    calls at one site in one forward are told apart by their order. The dimension of `x` whose
    size is the micro-batch's number of samples is taken as the batch (the first such). Without
    a Runtime that has set up a model, this is torch's `F.dropout`."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if _source is None:
        return nn.functional.dropout(x, p, training)
    if site is None:
        caller = sys._getframe(1)
        site = f"{caller.f_globals.get('__name__', '?')}:{caller.f_code.co_qualname}:{caller.f_lineno}"
    return _draw(x, p, site, None)


class Dropout(nn.Module):
    """`nn.Dropout` (or, with `channels`, `nn.Dropout1d/2d/3d`: whole channels of a sample) whose
    masks do not depend on the number of processes; `site` is its name in the model (what keys
    its draws). What `rt.setup` puts in place of torch's."""

    def __init__(self, p: float = 0.5, site: str = "dropout", channels: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.site, self.channels = p, site, channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if _source is None:
            return nn.functional.dropout(x, self.p, True) if not self.channels else _torch_channels(x, self.p)
        return _draw(x, self.p, self.site, 1 if self.channels else None)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}" + (", channels=True" if self.channels else "")


def _torch_channels(x: torch.Tensor, p: float) -> torch.Tensor:
    return nn.functional.dropout2d(x, p, True) if x.dim() == 4 else nn.functional.dropout1d(x, p, True)


REPLACED = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
NOT_REPLACED = (nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropout(model: nn.Module) -> list[str]:
    """Put a `Dropout` in place of each of the model's torch dropout modules (of those exact
    types: a subclass may do more), in place; a module found at two paths becomes one `Dropout`,
    named by its first path. Returns what still draws from the rank's stream (attention dropout
    inside nn.MultiheadAttention, alpha dropout), to be said."""
    made: dict[int, Dropout] = {}
    left = []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(module.named_children()):
            path = f"{name}.{child_name}" if name else child_name
            if type(child) in REPLACED:
                if id(child) not in made:
                    made[id(child)] = Dropout(child.p, path, channels=type(child) is not nn.Dropout)
                    made[id(child)].train(child.training)
                setattr(module, child_name, made[id(child)])
            elif isinstance(child, NOT_REPLACED) and child.p > 0:
                left.append(f"{path} ({type(child).__name__})")
            elif isinstance(child, nn.MultiheadAttention) and child.dropout > 0:
                left.append(f"{path} (nn.MultiheadAttention's attention dropout)")
    return sorted(set(left))
