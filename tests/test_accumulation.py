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


class _Recording:
    """A gradient-sync switch that records when the runtime turns it off (enter) and on (exit)."""

    def __init__(self, events: list[str]):
        self.events = events

    def __enter__(self) -> None:
        self.events.append("off")

    def __exit__(self, *exc: object) -> None:
        self.events.append("on")


def test_the_runtime_holds_every_micro_batch_a_resident_loader_hands_out_between_two_loaders_and_passes():
    """The resident pass does not tell the runtime a step's last MicroBatch it holds already
    (full global batches share one): whatever another loader or a pass end told it in between,
    it holds the current loader's micro-batch after every `next`, and turns gradient sync off
    before every micro-batch that is not a step's last."""
    import ddpkit

    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        rt.setup(nn.Linear(2, 1))
        events: list[str] = []
        rt._acc.no_sync = lambda: _Recording(events)  # one process has no sync to switch: record the switch
        whole = rt.loader(TensorDataset(torch.randn(14, 2)), batch_size=4)  # 4, 4, 4, then 2: two MicroBatch records
        micro = rt.loader(TensorDataset(torch.randn(9, 2)), batch_size=4, micro_batch_size=3)  # 3+1, 3+1, 1
        a, b = iter(whole), iter(micro)
        for loader, it in [(whole, a), (whole, a), (micro, b), (whole, a), (micro, b), (micro, b), (whole, a)]:
            events.clear()
            next(it)
            assert rt._acc.micro is loader.current and rt.step_ready == loader.current.last
            assert events == ([] if loader.current.last else ["off"])  # on again at the next tell or backward
            rt._acc.leave()
        assert next(a, None) is None  # whole's pass ends: nothing is current
        assert rt._acc.micro is None and rt.step_ready
        next(b)  # micro's last step, then a pass of whole left after its first step
        left = iter(whole)
        next(left)
        assert rt._acc.micro is whole.current and whole.position == 1
        del left  # the pass is closed
        assert rt._acc.micro is None
        del b
        assert len(list(micro)) == 1  # the rest of micro's epoch: its last step
        events.clear()
        assert len(list(micro)) == 5 and events == ["off", "on", "off", "on"]  # a whole epoch of micro


def test_resident_and_dataloader_loops_make_bitwise_the_same_updates_with_micro_batches_and_a_short_last_batch():
    """Training with `rt.backward` and `rt.step` gives the same weights from the resident pass
    (which skips telling the runtime what it holds already) as from the DataLoader path (which
    tells it every micro-batch), over epochs whose last global batch is short, with and
    without micro-batches; and steps as often."""
    import ddpkit

    data = TensorDataset(torch.randn(22, 3), torch.randn(22, 1))
    for micro in (None, 3):
        results = []
        for resident in (True, False):
            with ddpkit.Runtime(device="cpu", seed=0) as rt:
                model = nn.Linear(3, 1)
                model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
                loader = rt.loader(data, batch_size=8, micro_batch_size=micro, resident=resident)
                steps = 0
                for _ in range(2):
                    for x, y in loader:
                        loss = nn.functional.mse_loss(model(x), y)
                        rt.backward(loss)
                        steps += rt.step(opt)
                results.append((steps, model.weight.detach().clone(), model.bias.detach().clone()))
        (steps_r, *resident_w), (steps_d, *loader_w) = results
        assert steps_r == steps_d == 6
        assert all(torch.equal(r, d) for r, d in zip(resident_w, loader_w))
