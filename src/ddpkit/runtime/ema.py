"""`EMA`: an exponential moving average of a model's weights, kept beside them.

    ema = ddpkit.EMA(model, decay=0.999)       # after rt.setup()
    for x, y in train:
        rt.backward(loss_fn(model(x), y))
        if rt.step(opt):
            ema.update()
    with ema.swapped():                        # the model holds the averaged weights inside
        rt.print(rt.evaluate(model, test_set))
    rt.save("ckpt.pt", model=model, optimizer=opt, ema=ema)

Why not torch.optim.swa_utils.AveragedModel: it keeps a deep copy of the whole module, which
under fsdp would be a second sharded module (its own hooks and all-gathers, and a second model
for checkpoints and model.pt to know about), and its first update replaces the average with
the weights of that moment. Here the average is plain tensors shaped like the parameters (under
fsdp DTensors holding this rank's shards: 1/N of the weights per rank, no communication), and
the update is torch's own EMA step, `get_ema_multi_avg_fn` (one `torch._foreach_lerp_`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ..core import checks
from ..errors import UsageError
from ..strategy import stage_of, unwrap


class EMA:
    """An exponential moving average of `model`'s floating-point parameters, from the weights
    at construction on: after each `update()`, `average = decay * average + (1 - decay) * weights`.

    Build it after `rt.setup()` (fsdp replaces the parameters there) and call `update()` after
    each optimizer step that stepped. Buffers (BatchNorm's running statistics) are not
    averaged: `swapped()` and `rt.save` use the model's current ones, as timm's ModelEmaV3
    does with `exclude_buffers=True`. The average stays in the parameters' dtype and device.
    """

    saved_in_shards = True  # a checkpoint directory saves the average beside the model's shards

    def __init__(self, model: nn.Module, decay: float) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise UsageError(
                f"EMA decay must be between 0 and 1 (the weight kept at each step, as 0.999), got {checks.shown(decay)}"
            )
        named = [(name, p) for name, p in unwrap(model).named_parameters() if p.is_floating_point()]
        if not named:
            raise UsageError("EMA: the model has no floating-point parameters to average")
        self.decay, self._model = decay, model
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._first = next(unwrap(model).parameters())  # what fsdp's setup() would replace
        with torch.no_grad():
            self._average = [p.detach().clone() for p in self._params]
        self._lerp = get_ema_multi_avg_fn(decay)

    def update(self) -> None:
        """Move the average towards the current weights. No communication: each rank averages
        the values it holds (all of them, or under fsdp its shards)."""
        self._check_model()
        with torch.no_grad():
            self._lerp(_here(self._average), _here(self._params), None)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block the model holds the averaged weights (to evaluate or save them); its
        own weights come back bit for bit when the block ends. Costs one copy of the weights
        (this rank's shards under fsdp) while the block runs."""
        self._check_model()
        with torch.no_grad():
            weights = _here(self._params)
            kept = [w.clone() for w in weights]
            _copy(weights, _here(self._average))
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(weights, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged parameters by the bare model's names (no `module.` prefix): whole
        tensors, or under fsdp DTensors that a checkpoint directory saves shard by shard."""
        return dict(zip(self._names, self._average))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load averaged parameters saved by `state_dict()` under any strategy and world size
        (whole tensors into fsdp shards: each rank keeps its own part)."""
        if stage_of(self._model) is not None:  # a pipeline stage's average: its share of a whole model's
            state = {name: value for name, value in state.items() if name in self._names}
        missing, unexpected = set(self._names) - set(state), set(state) - set(self._names)
        if missing or unexpected:
            raise UsageError(
                f"EMA state does not fit this model (missing {sorted(missing)}, unexpected {sorted(unexpected)})"
            )
        with torch.no_grad():
            for name, average in zip(self._names, self._average):
                if state[name] is not average:  # a checkpoint directory loads in place
                    _here([average])[0].copy_(_part_like(state[name], average, name))

    @property
    def sharded(self) -> bool:
        """True under fsdp: the average is DTensors, each rank holding its shards."""
        return hasattr(self._average[0], "device_mesh")

    def _check_model(self) -> None:
        if next(unwrap(self._model).parameters()) is not self._first:
            raise UsageError("EMA: the model's parameters were replaced since it was built: build it after rt.setup()")


def _here(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of each tensor (a DTensor's local shard), sharing its memory: call
    under no_grad, where to_local() hands out the shard itself."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _copy(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    for target, source in zip(targets, sources):
        target.copy_(source)


def _part_like(value: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's part of `value` (a whole tensor) where `like` is a DTensor, else `value`."""
    if tuple(value.shape) != tuple(like.shape):
        raise UsageError(f"EMA state does not fit this model: {name} is {list(value.shape)}, here {list(like.shape)}")
    if not hasattr(like, "device_mesh") or hasattr(value, "device_mesh"):
        return _here([value])[0]
    from torch.distributed.tensor import distribute_tensor  # DTensor: 0.6 s to import, fsdp alone

    # src_data_rank=None: every rank holds the whole value already, and cuts out its own part.
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
