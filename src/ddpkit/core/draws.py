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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .log import print0

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "dropout"]

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
    """One 64-bit key of integers (each folded in 32 bits at a time into two 32-bit words)."""
    lo, hi = 0x3243F6A8, 0x85A308D3
    for part in parts:
        part &= (1 << 64) - 1  # (a negative seed as its two's complement)
        while True:
            word = part & _U32
            lo = _mix_int((lo ^ word) + 0x9E3779B9 & _U32)
            hi = _mix_int((hi + word ^ lo) & _U32)
            part >>= 32
            if not part:
                break
    return hi << 32 | lo


def site_id(name: str) -> int:
    """A call site's number: the same in every process (crc32, not Python's salted hash)."""
    return zlib.crc32(name.encode())


def keep_mask(rows: torch.Tensor, per_row: int, keyed: int, p: float) -> tuple[torch.Tensor, float]:
    """Which elements to keep, shaped (len(rows), per_row), for the rows' positions `rows` (an
    int64 tensor on the device) under the call's 64-bit key: each element a 16-bit uniform
    draw compared with p (p is so rounded to 1/65536), and the scale that keeps the mean,
    1/(1-p). A row's two 32-bit words enter each element's hash apart (xor, a mix, then add),
    so no two rows' streams are shifted copies of each other."""
    threshold = min(65536, round(p * 65536))
    first = _mix((rows.to(torch.int32) * _ROW) + _int32(keyed & _U32))
    second = _mix(first ^ _int32(keyed >> 32))
    half = (per_row + 1) // 2  # a 32-bit hash gives two 16-bit draws
    element = torch.arange(half, dtype=torch.int32, device=rows.device) * _ELEMENT
    draws = _mix(_mix(element ^ first[:, None]) + second[:, None]).view(torch.int16)[:, :per_row]
    if threshold == 65536:  # (32768 is no int16: the comparison would wrap it)
        return torch.zeros(draws.shape, dtype=torch.bool, device=draws.device), 0.0
    # A draw's bits read as a signed 16-bit number v are u - 32768 for u = v ^ 0x8000, an
    # unsigned 16-bit number: u >= threshold is v >= threshold - 32768.
    keep = draws >= threshold - 32768
    kept = 1.0 - threshold / 65536
    return keep, (1.0 / kept if kept > 0 else 0.0)


@dataclass
class Source:
    """What keys one Runtime's draws, read at each call (set by its setup()); and the state of
    its call sites: their call numbers in the current forward, their batch dimensions."""

    seed: Callable[[], int]
    step: Callable[[], int]  # optimizer steps taken
    micro: Callable[[], Any]  # the loader's current MicroBatch (its rows' place), or None
    rank: int  # the data rank (tensor-parallel ranks share their samples, so their draws too)
    forward: Callable[[], Any]  # changes with each micro-batch a loader hands out
    names: dict[int, str] = field(default_factory=dict)  # id(module) -> its name in the model
    active: bool = True  # until its Runtime closes
    calls: dict[str, list[int]] = field(default_factory=dict)  # site -> [calls, replays] this forward
    calls_key: Any = None
    dims: dict[str, int] = field(default_factory=dict)  # site -> the batch dimension it was found at
    warned: set[str] = field(default_factory=set)

    def say_once(self, site: str, what: str) -> None:
        if site not in self.warned:
            self.warned.add(site)
            print0(f"ddpkit: dropout at {site}: {what}", file=sys.stderr)


_current: Source | None = None  # the last Runtime's that set up a model: the functional form's


def follow(source: Source | None) -> None:
    """Key the functional form's draws by `source` from now on (None: torch's dropout)."""
    global _current
    _current = source


def leave(source: Source) -> None:
    """`source`'s Runtime closed: its modules and the functional form go back to torch's."""
    global _current
    source.active = False
    if _current is source:
        _current = None


def _call_number(src: Source, site: str) -> int:
    """This site's call number in the current micro-batch's forward. A forward replayed in the
    backward (activation checkpointing recomputes it there) gets the numbers the forward had,
    in the forward's order."""
    now = (src.step(), src.forward())
    if now != src.calls_key:
        src.calls_key = now
        src.calls.clear()
    counts = src.calls.setdefault(site, [0, 0])
    if torch._C._current_graph_task_id() != -1 and counts[0]:  # recomputed in a backward
        if counts[0] > 1:
            src.say_once(
                site + " (recomputed)",
                f"called {counts[0]} times in a forward and recomputed by activation checkpointing: its masks "
                "are replayed in the forward's order, which is right only if one checkpointed region makes all "
                "those calls (give each block a Dropout of its own)",
            )
        number = counts[1] % counts[0]
        counts[1] += 1
        return number
    counts[0] += 1
    return counts[0] - 1


# Kept out of compiled graphs (the keys live in Python: a graph would bake one step's in) by
# torch's own lazy form of torch.compiler.disable, as torch.optim's methods are: torch's compiler
# (a second to import) loads at the first draw, not when this module is imported.
@torch._disable_dynamo
def _draw(
    src: Source, x: torch.Tensor, p: float, site: str, channels: bool, batch_dim: int | None, inplace: bool = False
) -> torch.Tensor:
    number = _call_number(src, site)
    micro = src.micro()
    dim = None if micro is None else _batch_dim(src, site, x, micro, batch_dim)
    sid = site_id(site)
    if dim is None:  # the batch's place is unknown: keys of this rank's own, rows by their place here
        keyed, first, dim = key(src.seed(), src.step(), sid, number, 1, src.rank), 0, 0
    else:
        keyed, first = key(src.seed(), src.step(), sid, number, 0), micro.start
    moved = x.movedim(dim, 0) if dim else x
    rows = torch.arange(first, first + moved.shape[0], device=x.device)
    per_row = moved[0].numel() if moved.shape[0] else 0
    if channels:
        shape = (*moved.shape[:2], *[1] * (moved.dim() - 2))
        per_row = moved.shape[1]
    else:
        shape = moved.shape
    keep, scale = keep_mask(rows, per_row, keyed, p)
    if inplace:  # as torch's inplace dropout: x itself, zeroed where dropped and scaled
        moved.masked_fill_(~keep.reshape(shape), 0).mul_(scale)
        return x
    out = torch.where(keep.reshape(shape), moved * scale, moved.new_zeros(()))
    out = out.movedim(0, dim) if dim else out
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last)  # the layout it came in
    return out


def _batch_dim(src: Source, site: str, x: torch.Tensor, micro: Any, given: int | None) -> int | None:
    """Which dimension of `x` holds the current micro-batch's samples: `given`, else the one this
    site was found at before, else the only one whose size is the number of samples (the first
    of several, said once: give batch_dim); None when none is (said once)."""
    size, shape = micro.size, x.shape
    for known in (given, src.dims.get(site)):
        if known is not None and -x.dim() <= known < x.dim() and shape[known] == size:
            return known % x.dim()
    matches = [d for d in range(x.dim()) if shape[d] == size]
    if len(matches) == 1:
        src.dims[site] = matches[0]
        return matches[0]
    if matches:
        src.say_once(
            site + " (dims)",
            f"dimensions {matches} of its input {tuple(shape)} all have the micro-batch's {size} samples; "
            f"taking {matches[0]} as the batch (batch_dim= says which)",
        )
        return matches[0]
    src.say_once(
        site,
        f"no dimension of its input {tuple(shape)} has the micro-batch's {size} samples; its masks depend on "
        "the rank (and so on the number of processes)",
    )
    return None


def _caller_site(frame: Any, src: Source) -> str:
    """A functional call's site: the module whose forward called it (by its name in the model,
    so each block of a model is a site of its own) or the calling function, and the line."""
    owner = frame.f_locals.get("self")
    where = src.names.get(id(owner)) if owner is not None else None
    if where is None:
        where = f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_qualname}"
    return f"{where}:{frame.f_lineno}"


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    site: str | None = None,
    batch_dim: int | None = None,
) -> torch.Tensor:
    """`F.dropout(x, p, training)`, with a mask that does not depend on the number of processes
    (see the module's docstring): for dropout in a forward of your own.

    `site` names the call (default: the module whose forward calls it, by its name in the
    model, or the calling function, and the line: the same in every process); calls at one site
    in one forward are told apart by their order. `batch_dim` is the dimension of the samples
    (default: the one whose size is the micro-batch's number of samples). Without a Runtime
    that has set up a model, this is torch's `F.dropout`."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    src = _current
    if not training or p == 0.0 or src is None:
        return nn.functional.dropout(x, p, training)
    if site is None:
        site = _caller_site(sys._getframe(1), src)
    return _draw(src, x, p, site, False, batch_dim)


class Dropout(nn.Dropout):
    """`nn.Dropout` whose masks do not depend on the number of processes, keyed by `site` (its
    name in the model) and the Runtime that set the model up; what `rt.setup` puts in place of
    torch's. `batch_dim`: the dimension of the samples (default: found by the micro-batch's
    size). Outside a Runtime's run (before setup, after close) it is torch's dropout."""

    CHANNELS = False  # Dropout1d/2d/3d: whole channels of a sample
    TORCH: type[nn.Module] = nn.Dropout  # what it replaces: its forward, outside a Runtime's run

    def __init__(self, p: float = 0.5, site: str = "dropout", batch_dim: int | None = None, inplace: bool = False):
        super().__init__(p, inplace)
        self.site, self.batch_dim = site, batch_dim
        self.source: Source | None = None  # set by replace_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.source
        if not self.training or self.p == 0.0 or src is None or not src.active or not self._batched(x):
            return self.TORCH.forward(self, x)  # torch's
        return _draw(src, x, self.p, self.site, self.CHANNELS, self.batch_dim, self.inplace)

    def _batched(self, x: torch.Tensor) -> bool:
        return x.dim() >= 1

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"


class _Channels(Dropout):
    CHANNELS = True
    DIMS = 3  # a batched input's dimensions

    def _batched(self, x: torch.Tensor) -> bool:
        return x.dim() == self.DIMS  # an unbatched input (no sample dimension): torch's


class Dropout1d(_Channels, nn.Dropout1d):
    """`nn.Dropout1d` (whole channels of (N, C, L)) with `Dropout`'s masks."""

    DIMS, TORCH = 3, nn.Dropout1d


class Dropout2d(_Channels, nn.Dropout2d):
    """`nn.Dropout2d` (whole channels of (N, C, H, W)) with `Dropout`'s masks."""

    DIMS, TORCH = 4, nn.Dropout2d


class Dropout3d(_Channels, nn.Dropout3d):
    """`nn.Dropout3d` (whole channels of (N, C, D, H, W)) with `Dropout`'s masks."""

    DIMS, TORCH = 5, nn.Dropout3d


REPLACED = {nn.Dropout: Dropout, nn.Dropout1d: Dropout1d, nn.Dropout2d: Dropout2d, nn.Dropout3d: Dropout3d}
NOT_REPLACED = (nn.AlphaDropout, nn.FeatureAlphaDropout)


def replace_dropout(model: nn.Module, source: Source) -> list[str]:
    """Put ddpkit's dropout, keyed by `source`, in place of each of the model's torch dropout
    modules (of those exact types: a subclass may do more), in place; a module found at two
    paths becomes one, named by its first path. ddpkit's own already there are keyed by
    `source` too. Returns what still draws from the rank's stream (attention dropout inside
    nn.MultiheadAttention, alpha dropout), to be said."""
    made: dict[int, Dropout] = {}
    left = []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        source.names.setdefault(id(module), name or "model")
        for child_name, child in list(module.named_children()):
            path = f"{name}.{child_name}" if name else child_name
            if type(child) in REPLACED:
                if id(child) not in made:
                    made[id(child)] = REPLACED[type(child)](child.p, path, inplace=child.inplace)
                    made[id(child)].train(child.training)
                setattr(module, child_name, made[id(child)])
            elif isinstance(child, NOT_REPLACED) and child.p > 0:
                left.append(f"{path} ({type(child).__name__})")
            elif isinstance(child, nn.MultiheadAttention) and child.dropout > 0:
                left.append(f"{path} (nn.MultiheadAttention's attention dropout)")
    for module in model.modules():
        if isinstance(module, Dropout):
            module.source = source
            source.names[id(module)] = module.site
    return sorted(set(left))


def key_dropout(model: nn.Module, source: Source) -> None:
    """What `rt.setup` does: `replace_dropout`, then rank 0 says what still draws from the
    rank's own stream, and `source` keys the masks from here on."""
    left = replace_dropout(model, source)
    if left:
        print0(
            f"ddpkit: {', '.join(left)}: still drawn from each rank's own stream, so it depends on the "
            "number of processes (ddpkit.dropout in your forward is the invariant form)",
            file=sys.stderr,
        )
    follow(source)


def say_kept(model: nn.Module, why: str) -> None:
    """Rank 0 says that the model keeps torch's dropout (`why`: under what), if it has any."""
    if any(type(m) in REPLACED and m.p > 0 for m in model.modules()):
        print0(
            f"ddpkit: {why} the model keeps torch's dropout, whose masks depend on the number of processes",
            file=sys.stderr,
        )
