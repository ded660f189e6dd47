"""A worker for trainer/test_loop.py: the built-in loop's finiteness check on each rank."""

from __future__ import annotations

from typing import Any


def check_finite_facts(out: str) -> list[str]:
    """The loop's check on every rank after: nothing wrong; rank 1 alone saw a bad loss at
    step 7 (rank 0 at step 9); rank 1's weights alone hold a NaN. What each raised ("" for
    nothing)."""
    import torch

    import ddpkit
    from ddpkit.trainer import TrainConfig, resolve
    from ddpkit.trainer.loop import Loop
    from ddpkit.trainer.outputs import Outputs

    cfg = TrainConfig(model="mlp", epochs=1, batch_size=64, device="cpu", out=out)
    with ddpkit.Runtime(device="cpu", seed=0) as rt, Outputs(cfg, rt.is_main) as outputs:
        loop = Loop(rt, resolve(cfg))
        said = [_raised(loop.check_finite, outputs)]
        loop.first_bad.fill_(7 if rt.rank == 1 else 9)
        said.append(_raised(loop.check_finite, outputs))
        loop.first_bad.fill_(-1)
        if rt.rank == 1:
            with torch.no_grad():
                next(loop.model.parameters()).view(-1)[0] = float("nan")
        said.append(_raised(loop.check_finite, outputs))
    return said


def _raised(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except FloatingPointError as err:
        return str(err)
    return ""
