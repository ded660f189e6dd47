"""Numeric precision: fp32, bf16 or fp16 autocast, with a GradScaler for fp16.

`Precision` owns the autocast context and the backward/step pair, so the training loop reads
the same whatever the precision.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from . import checks
from .tree import map_tensors

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name, self.device = checks.choice("--precision", name, PRECISIONS), device
        # fp16 has a narrow exponent range: small gradients underflow to zero unless the loss
        # is scaled up first. bf16 has fp32's range and needs no scaler.
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    @property
    def dtype(self) -> torch.dtype:
        """What the forward computes in: bfloat16, float16, or float32."""
        return _DTYPES.get(self.name, torch.float32)

    def autocast(self) -> AbstractContextManager[Any]:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.name])

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The loss's backward (scaled under fp16); `kwargs` are torch's (`retain_graph`, `inputs`)."""
        (self.scaler.scale(loss) if self.scaler else loss).backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step if gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping them)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def outputs_to_fp32(out: Any) -> Any:
    """Cast half-precision outputs of an autocast forward back to fp32, so a loss computed
    outside the autocast block is computed in full precision. Container types are kept; float64
    outputs (a float64 model) stay float64."""
    return map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)


class AutocastModule(nn.Module):
    """Runs the wrapped module's forward under the precision's autocast and returns fp32 outputs.

    A module (not a patched `forward`) so the model still deep-copies and pickles, and so that
    it can sit *inside* DataParallel: autocast state is per thread, and DataParallel runs each
    replica's forward in a thread of its own. `strategy.unwrap` removes it before saving.
    """

    def __init__(self, module: nn.Module, precision: Precision):
        super().__init__()
        self.module = module
        self.device_type, self.dtype = precision.device.type, _DTYPES[precision.name]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return outputs_to_fp32(out)
