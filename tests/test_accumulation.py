"""`accumulation`: a training pass left after an early micro-batch does not leave the runtime
waiting for the rest of the step, nor weighting a batch from elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.unit


def test_runtime_forgets_the_micro_batch_when_a_pass_ends():
    import ddpkit

    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = rt.setup(nn.Linear(2, 1))
        loader = rt.loader(TensorDataset(torch.randn(8, 2)), batch_size=8, micro_batch_size=4)
        for (_x,) in loader:
            break  # left after the first of two micro-batches
        assert rt.step_ready  # not stuck waiting for a micro-batch that will not come
        x = torch.ones(1, 2)
        model(x).sum().backward()
        plain = model.weight.grad.clone()
        model.zero_grad()
        rt.backward(model(x).sum())  # a batch from elsewhere: no training-batch weighting
        assert torch.equal(model.weight.grad, plain)
