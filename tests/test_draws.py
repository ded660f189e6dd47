"""ddpkit's dropout (ddpkit.draws): masks that are a function of the run (seed, step, call site,
the sample's place in the global batch), computed on the device, the same however the batch is
split. The runs on 1, 2 and 3 processes are in test_own_loop.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ddpkit
from ddpkit import draws
from ddpkit.data.samplers import MicroBatch

pytestmark = pytest.mark.unit


@pytest.fixture
def source():
    """Draws keyed by a stand-in for the Runtime: step, micro-batch and forward are settable."""
    state = {"step": 0, "micro": None, "forward": 0}
    draws.follow(draws.Source(7, lambda: state["step"], lambda: state["micro"], 0, lambda: state["forward"]))
    yield state
    draws.follow(None)


def test_the_hash_on_tensors_is_the_hash_on_integers_at_every_length():
    # Vectorized kernels and their scalar tails must wrap alike: every length up to 70.
    rng = random.Random(0)
    for n in range(1, 70):
        values = [rng.getrandbits(32) for _ in range(n)]
        as_int32 = torch.tensor([draws._int32(v) for v in values], dtype=torch.int32)
        got = [v & 0xFFFFFFFF for v in draws._mix(as_int32).tolist()]
        assert got == [draws._mix_int(v) for v in values]


def test_a_rows_mask_is_the_same_whether_it_is_drawn_with_others_or_alone():
    whole, _ = draws.keep_mask(torch.arange(16), 37, 1234, 0.3)
    parts = [draws.keep_mask(torch.arange(a, b), 37, 1234, 0.3)[0] for a, b in ((0, 5), (5, 6), (6, 16))]
    assert torch.equal(whole, torch.cat(parts))
    other_key, _ = draws.keep_mask(torch.arange(16), 37, 1235, 0.3)
    assert not torch.equal(whole, other_key)
    assert not torch.equal(whole[0], whole[1])  # each row its own mask


def test_the_draws_keep_the_rate_and_do_not_follow_their_neighbours():
    keep, scale = draws.keep_mask(torch.arange(64), 4096, 99, 0.25)
    dropped = (~keep).double()
    n = dropped.numel()
    assert abs(dropped.mean().item() - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    assert scale == pytest.approx(1 / 0.75)
    centred = dropped - dropped.mean()
    for a, b in ((centred[:, 1:], centred[:, :-1]), (centred[1:], centred[:-1]), (centred[:, 2:], centred[:, :-2])):
        corr = (a * b).mean() / centred.var()
        assert abs(corr.item()) < 0.01, corr  # independent: |corr| ~ 1/sqrt(n) = 0.002
    assert draws.keep_mask(torch.arange(3), 10, 1, 0.0)[0].all()
    assert not draws.keep_mask(torch.arange(3), 10, 1, 1.0)[0].any()


def test_the_masks_follow_the_step_the_site_the_call_and_the_samples_place(source):
    x = torch.ones(8, 50)
    source["micro"] = MicroBatch(8, 24, False, start=8)
    first = ddpkit.dropout(x, 0.5, site="a")
    assert set(first.unique().tolist()) == {0.0, 2.0}
    again = ddpkit.dropout(x, 0.5, site="a")  # the same site called twice in a forward: another mask
    other_site = ddpkit.dropout(x, 0.5, site="b")
    source["forward"] += 1  # the next micro-batch's forward: numbers begin again
    source["micro"] = MicroBatch(4, 24, False, start=12)
    later_rows = ddpkit.dropout(x[:4], 0.5, site="a")
    assert torch.equal(later_rows, first[4:])  # rows 12..15 of the global batch, drawn again
    assert not torch.equal(again, first) and not torch.equal(other_site, first)
    source["step"] += 1
    source["forward"] += 1
    assert not torch.equal(ddpkit.dropout(x[:4], 0.5, site="a"), later_rows)


def test_the_batch_is_the_dimension_of_the_micro_batchs_size(source):
    source["micro"] = MicroBatch(3, 3, True, start=0)
    x = torch.randn(5, 3, 40)  # (T, B, C), as nn.Transformer's default layout
    batch_first = ddpkit.dropout(x.transpose(0, 1).contiguous(), 0.4, site="s")
    source["forward"] += 1
    assert torch.equal(ddpkit.dropout(x, 0.4, site="s").transpose(0, 1), batch_first)


def test_an_input_without_the_batch_says_once_that_its_masks_depend_on_the_rank(source, capsys):
    source["micro"] = MicroBatch(4, 4, True, start=0)
    for _ in range(2):
        out = ddpkit.dropout(torch.ones(7, 9), 0.5, site="weights")
        assert out.shape == (7, 9) and (out == 0).any()
    err = capsys.readouterr().err
    assert err.count("dropout at weights") == 1 and "depend on the rank" in err


def test_the_gradient_is_the_mask_and_a_checkpointed_forward_replays_its_masks(source):
    torch.manual_seed(0)
    layer = nn.Linear(20, 20)
    x = torch.randn(6, 20, requires_grad=True)
    source["micro"] = MicroBatch(6, 6, True, start=0)
    out = ddpkit.dropout(x, 0.5, site="g")
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out.detach() != 0).float() * 2, rtol=0, atol=0)

    def block(h):
        return ddpkit.dropout(layer(h).relu(), 0.5, site="c") * 3

    grads = []
    for wrapped in (False, True):
        source["forward"] += 1
        layer.zero_grad()
        y = checkpoint(block, x, use_reentrant=False) if wrapped else block(x)
        y.pow(2).sum().backward()
        grads.append(layer.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_without_a_runtime_it_is_torchs_dropout():
    torch.manual_seed(3)
    expected = F.dropout(torch.ones(100), 0.3)
    torch.manual_seed(3)
    assert torch.equal(ddpkit.dropout(torch.ones(100), 0.3), expected)
    assert torch.equal(ddpkit.Dropout(0.3).eval()(torch.ones(5)), torch.ones(5))
    with pytest.raises(ValueError, match="between 0 and 1"):
        ddpkit.dropout(torch.ones(2), 1.5)


def test_setup_puts_ddpkits_dropout_in_place_of_torchs_and_names_what_it_leaves(capsys):
    class Mine(nn.Dropout):
        pass

    shared = nn.Dropout(0.1)
    model = nn.Sequential(
        nn.Linear(4, 4),
        shared,
        nn.Sequential(shared, nn.Dropout2d(0.2), Mine(0.3), nn.AlphaDropout(0.1)),
        nn.MultiheadAttention(4, 2, dropout=0.1),
    )
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = rt.setup(model)
        assert isinstance(model[1], ddpkit.Dropout) and model[2][0] is model[1]
        assert model[1].site == "1" and model[1].p == 0.1 and not model[1].channels
        assert isinstance(model[2][1], ddpkit.Dropout) and model[2][1].channels and model[2][1].site == "2.1"
        assert type(model[2][2]) is Mine  # a subclass may do more than dropout: left alone
    err = capsys.readouterr().err
    assert "2.3 (AlphaDropout)" in err and "3 (nn.MultiheadAttention's attention dropout)" in err
    with ddpkit.Runtime(device="cpu", seed=0, invariant_dropout=False) as rt:
        assert type(rt.setup(nn.Sequential(nn.Dropout(0.5)))[0]) is nn.Dropout


def test_channel_dropout_drops_whole_channels_of_each_sample(source):
    source["micro"] = MicroBatch(4, 4, True, start=0)
    out = ddpkit.Dropout(0.5, "c2", channels=True)(torch.ones(4, 16, 3, 3))
    per_channel = out.flatten(2)
    assert ((per_channel == 0).all(2) | (per_channel == 2).all(2)).all()
    assert (per_channel == 0).any() and (per_channel == 2).any()
