"""Activation checkpointing (`Runtime(activation_checkpointing=...)`,
`ddpkit train --activation-checkpointing`): the chosen blocks keep only their inputs for the
backward pass, so far fewer bytes are saved for it, and the gradients, the weights and the
dropout masks are the same to the last bit, on one process and under ddp and fsdp (the fsdp run
through the command: tests/cli/test_train_gpt.py). Bad choices are one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import models
from ddpkit.errors import UsageError
from ddpkit.strategy import activations
from tests import workers


def _saved_bytes_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[int, dict]:
    """The bytes autograd keeps for the backward of one forward, and the gradients it gives."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    return total[0], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.unit
def test_checkpointed_blocks_save_a_twelfth_for_backward_with_the_same_gradients_and_names():
    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    measured = {}
    for choice in (None, True):
        with ddpkit.Runtime("single", device="cpu", seed=0, activation_checkpointing=choice) as rt:
            torch.manual_seed(1)
            model = rt.setup(models.build("gpt", (64,), 256, width=128, depth=4, heads=4, dropout=0.2))
            measured[choice] = (*_saved_bytes_and_grads(model, x), list(model.state_dict()), model)
    (plain, grads, names, _), (kept, again, names_again, checkpointed) = measured[None], measured[True]
    assert kept * 12 < plain, (kept, plain)  # measured: 1,841,152 of 22,236,672 bytes
    assert grads.keys() == again.keys() and all(torch.equal(grads[k], again[k]) for k in grads)  # dropout too
    assert names == names_again  # no wrapper: no prefix in a state_dict or a checkpoint
    assert isinstance(checkpointed.block0, models.Block) and activations.is_checkpointed(checkpointed.block0)


def _peak_bytes_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The peak of the tensors alive over one forward and backward (torch's MemTracker: the
    tensors a selective checkpoint keeps are not autograd's saved tensors), and the gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(x).float().logsumexp(-1).mean().backward()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(sum(v for v in by_kind.values()) for by_kind in peak.values()), torch.cat(
        [p.grad.flatten() for p in model.parameters()]
    )


@pytest.mark.unit
def test_selective_checkpointing_keeps_more_than_full_and_less_than_none_with_the_same_gradients():
    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    measured = {}
    for choice, mode in ((None, "full"), (True, "full"), (True, "selective")):
        with ddpkit.Runtime(
            "single", device="cpu", seed=0, activation_checkpointing=choice, activation_checkpointing_mode=mode
        ) as rt:
            torch.manual_seed(1)
            shape = {"width": 64, "depth": 3, "heads": 4, "style": "llama", "kv_heads": 2, "dropout": 0.2}
            model = rt.setup(models.build("gpt", (64,), 256, **shape))
            measured[choice and mode] = _peak_bytes_and_grads(model, x)
    (plain, grads), (full, again), (selective, also) = measured[None], measured["full"], measured["selective"]
    assert full < selective < plain, (full, selective, plain)  # measured: 6.1, 8.0 and 13.7 MB
    assert torch.equal(grads, again) and torch.equal(grads, also)  # dropout masks included
    with pytest.raises(UsageError, match="activation_checkpointing_mode"):
        ddpkit.Runtime("single", device="cpu", activation_checkpointing=True, activation_checkpointing_mode="some")


@pytest.mark.unit
def test_the_choice_picks_classes_names_and_outermost_modules():
    model = models.build("gpt", (8,), 256, width=16, depth=3, heads=2)
    assert [n for n, _ in activations.chosen(model, True)] == ["embed", "block0", "block1", "block2", "head"]
    assert [n for n, _ in activations.chosen(model, models.Block)] == ["block0", "block1", "block2"]
    by_name = activations.chosen(model, lambda name, m: name in ("block1", "block1.attn"))
    assert [n for n, _ in by_name] == ["block1"]  # a module inside a chosen one is not chosen again
    assert activations.chosen(model, None) == [] and activations.chosen(model, False) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "choice,says",
    [
        ("blocks", r"True, module classes or a callable \(name, module\) -> bool, not 'blocks'"),
        (3, r"not 3"),
        ((models.Block, "x"), r"not \(<type>, 'x'\)"),
        (nn.LSTM, r"no module of the model \(GPT\) is chosen"),
    ],
)
def test_a_bad_choice_is_one_usage_error(choice, says):
    with pytest.raises(UsageError, match=says):
        with ddpkit.Runtime("single", device="cpu", activation_checkpointing=choice) as rt:
            rt.setup(models.build("gpt", (8,), 256, width=16, depth=1, heads=2))


@pytest.mark.distributed
def test_checkpointed_ddp_with_dropout_ends_bit_identical_on_two_processes():
    out = ddpkit.launch(workers.checkpointed_steps, "ddp", nproc=2)
    for rank in (out[0], out[1]):
        assert rank["strategy"] == "ddp" and rank["blocks"] == ["embed", "block0", "block1", "head"]
        assert torch.equal(rank["checkpointed"], rank["plain"])
    assert torch.equal(out[0]["checkpointed"], out[1]["checkpointed"])
