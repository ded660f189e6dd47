"""`precision`: autocast runs inside the wrapped model and hands back fp32 outputs (a copy of the
wrapped model is a model of its own, and it still pickles), and bf16/fp16 train on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.strategy import unwrap
from tests import workers


@pytest.mark.unit
def test_autocast_module_runs_inner_layers_in_bf16_and_returns_fp32():
    import copy
    import pickle as pk
    from collections import namedtuple

    import ddpkit

    Out = namedtuple("Out", "logits aux")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return Out(self.lin(x), {"h": self.lin(x)})

    seen = []
    with ddpkit.Runtime(precision="bf16", device="cpu") as rt:
        net = Net()
        net.lin.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        model = rt.setup(net)
        out = model(torch.randn(2, 4))
    assert seen == [torch.bfloat16, torch.bfloat16]  # autocast really ran inside
    assert isinstance(out, Out) and out.logits.dtype == torch.float32 and out.aux["h"].dtype == torch.float32
    assert unwrap(model) is net and list(unwrap(model).state_dict()) == ["lin.weight", "lin.bias"]
    twin = copy.deepcopy(model)  # a copy (EMA, teacher) must be its own model, not a view of this one
    with torch.no_grad():
        unwrap(twin).lin.weight.zero_()
        unwrap(twin).lin.bias.zero_()
    assert torch.count_nonzero(twin(torch.randn(2, 4)).logits) == 0
    assert torch.count_nonzero(model(torch.randn(2, 4)).logits) > 0
    with ddpkit.Runtime(precision="bf16", device="cpu") as rt:
        plain = rt.setup(nn.Linear(4, 3))
    assert torch.equal(pk.loads(pk.dumps(plain)).module.weight, plain.module.weight)  # still pickles


@pytest.mark.unit
def test_precision_bf16_and_fp16_train_on_cpu():
    for precision in ("bf16", "fp16"):
        out = workers.train_steps(steps=6, global_batch=12, precision=precision)
        assert torch.isfinite(out["end"]).all()
        assert not torch.equal(out["start"], out["end"])
