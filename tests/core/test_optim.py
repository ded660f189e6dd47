"""`optim`: the momentum setting reaches the optimizer (0 means plain SGD, the default is Nesterov)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.errors import UsageError
from ddpkit.trainer import TrainConfig, resolve

pytestmark = pytest.mark.unit


def test_momentum_reaches_the_optimizer():
    from ddpkit.optim import build_optimizer

    params = [nn.Parameter(torch.zeros(2))]
    plain = build_optimizer("sgd", params, 0.1, momentum=TrainConfig(momentum=0.0).momentum).param_groups[0]
    assert plain["momentum"] == 0.0 and plain["nesterov"] is False
    default = build_optimizer("sgd", params, 0.1, momentum=TrainConfig().momentum).param_groups[0]
    assert default["momentum"] == 0.9 and default["nesterov"] is True
    with pytest.raises(UsageError, match="--momentum"):
        resolve(TrainConfig(momentum=1.5))
