"""Model states by arithmetic: the bytes per parameter of each state, and over how many ranks
each is sharded. This is the accounting of the ZeRO paper (Rajbhandari et al., 2020, section
5.2 and Figure 1) and of DeepSpeed's memory estimators; `ddpkit plan` checks its traced figures
against it, and tests/plan/test_states.py reproduces the published figures with it.

Mixed-precision Adam, as the ZeRO paper counts it: 2 bytes of fp16 parameters, 2 of fp16
gradients, and K = 12 of optimizer state (an fp32 copy of the parameters, Adam's two moments).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class State:
    """One model state: `bytes_per_param`, whether it is sharded over the data-parallel ranks,
    and whether it lives on the GPU (False: offloaded to host memory)."""

    name: str
    bytes_per_param: float
    sharded: bool = False
    on_gpu: bool = True


def zero(stage: int, params: float = 2, grads: float = 2, optimizer: float = 12) -> tuple[State, ...]:
    """The states of ZeRO stage 0 (plain data parallel: ddp), 1 (optimizer states sharded), 2
    (gradients too) or 3 (parameters too: fsdp)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    return (
        State("parameters", params, sharded=stage >= 3),
        State("gradients", grads, sharded=stage >= 2),
        State("optimizer", optimizer, sharded=stage >= 1),
    )


def deepspeed_zero2(offload: bool = False) -> tuple[State, ...]:
    """DeepSpeed's own ZeRO-2 accounting (`estimate_zero2_model_states_mem_needs`): fp16
    parameters and a whole fp16 gradient buffer on every GPU; the fp32 parameters, fp32
    gradients and Adam's two moments (16 bytes) sharded, or in host memory with CPU offload,
    where the gradient buffer is not counted on the GPU either."""
    return (
        State("parameters", 2),
        State("gradients", 2, on_gpu=not offload),
        State("optimizer", 16, sharded=True, on_gpu=not offload),
    )


def per_gpu_bytes(states: tuple[State, ...], parameters: float, ranks: int) -> dict[str, float]:
    """Each state's bytes on one GPU for a model of `parameters` over `ranks` data-parallel
    ranks, and their `total`."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    out = {s.name: (s.bytes_per_param * parameters / (ranks if s.sharded else 1) if s.on_gpu else 0.0) for s in states}
    out["total"] = sum(out.values())
    return out
