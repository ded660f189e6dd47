"""Numeric precision: fp32, bf16 or fp16 autocast, with a GradScaler for fp16.

`Precision` owns the autocast context and the backward/step pair, so the training loop reads
the same whatever the precision.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device):
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
        self.name, self.device = name, device
        # fp16 has a narrow exponent range: small gradients underflow to zero unless the loss
        # is scaled up first. bf16 has fp32's range and needs no scaler.
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> ContextManager[Any]:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.name])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

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
    """Cast floating outputs of an autocast forward back to fp32, so a loss computed outside
    the autocast block is computed in full precision."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float32 else out
    if isinstance(out, (list, tuple)):
        return type(out)(outputs_to_fp32(o) for o in out)
    if isinstance(out, dict):
        return {k: outputs_to_fp32(v) for k, v in out.items()}
    return out
