"""ddpkit's dropout (ddpkit.core.draws): masks that are a function of the run (seed, step, call site,
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
from ddpkit.core import draws
from ddpkit.data.samplers import MicroBatch

pytestmark = pytest.mark.unit


def stand_in(state: dict, rank: int = 0) -> draws.Source:
    """Keys of a stand-in for the Runtime: step, micro-batch and forward are read from `state`."""
    return draws.Source(lambda: 7, lambda: state["step"], lambda: state["micro"], rank, lambda: state["forward"])


@pytest.fixture
def source():
    state = {"step": 0, "micro": None, "forward": 0}
    src = stand_in(state)
    draws.follow(src)
    state["source"] = src
    yield state
    draws.leave(src)


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


def test_the_gradient_is_the_mask(source):
    x = torch.randn(6, 20, requires_grad=True)
    source["micro"] = MicroBatch(6, 6, True, start=0)
    out = ddpkit.dropout(x, 0.5, site="g")
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out.detach() != 0).float() * 2, rtol=0, atol=0)


class Blocks(nn.Module):
    """Three blocks, each calling ddpkit.dropout at one line of code: a site per block (by the
    block's name in the model), called once per forward."""

    def __init__(self, checkpointed: str | None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointed is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointed == "reentrant")
        return x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(20, 20)

    def forward(self, x):
        return ddpkit.dropout(self.layer(x).relu(), 0.5) + x


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_a_checkpointed_forward_replays_each_blocks_masks(source, how):
    # The same line in every block is a site per block: its recomputation, which runs the
    # blocks in reverse order, gets each block's masks back. (One site across blocks got the
    # masks of another block: wrong gradients, nothing said.)
    grads = []
    for checkpointed in (None, how):
        torch.manual_seed(0)
        model = Blocks(checkpointed)
        draws.replace_dropout(model, source["source"])
        x = torch.randn(6, 20, requires_grad=True)
        source["micro"] = MicroBatch(6, 6, True, start=0)
        source["forward"] += 1
        model(x).pow(2).sum().backward()
        grads.append([b.layer.weight.grad for b in model.blocks])
    for plain, replayed in zip(*grads):
        assert torch.equal(plain, replayed)


def test_a_site_called_in_several_checkpointed_regions_is_said(source, capsys):
    shared = ddpkit.Dropout(0.5, "shared")
    shared.source = source["source"]
    layers = [nn.Linear(8, 8) for _ in range(2)]
    x = torch.randn(4, 8, requires_grad=True)
    source["micro"] = MicroBatch(4, 4, True, start=0)
    h = x
    for layer in layers:
        h = checkpoint(lambda t, layer=layer: shared(layer(t)), h, use_reentrant=False)
    h.sum().backward()
    assert "dropout at shared (recomputed): called 2 times in a forward" in capsys.readouterr().err


def test_without_a_runtime_it_is_torchs_dropout():
    torch.manual_seed(3)
    expected = F.dropout(torch.ones(100), 0.3)
    torch.manual_seed(3)
    assert torch.equal(ddpkit.dropout(torch.ones(100), 0.3), expected)
    assert torch.equal(ddpkit.Dropout(0.3).eval()(torch.ones(5)), torch.ones(5))
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match="between 0 and 1"):
            ddpkit.dropout(torch.ones(2), bad, training=False)  # refused as torch refuses it: always
    # the channel forms outside a Runtime's run are torch's own, each for its dimensions
    for made, shape in (
        (draws.Dropout1d, (2, 3, 4)),
        (draws.Dropout2d, (2, 3, 4, 4)),
        (draws.Dropout3d, (2, 3, 2, 2, 2)),
    ):
        out = made(0.5, "c")(torch.ones(shape)).flatten(2)
        assert ((out == 0).all(2) | (out == 2).all(2)).all()


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
        assert model[1].site == "1" and model[1].p == 0.1 and isinstance(model[1], nn.Dropout)
        assert isinstance(model[2][1], draws.Dropout2d) and isinstance(model[2][1], nn.Dropout2d)
        assert model[2][1].site == "2.1"
        assert type(model[2][2]) is Mine  # a subclass may do more than dropout: left alone
    err = capsys.readouterr().err
    assert "2.3 (AlphaDropout)" in err and "3 (nn.MultiheadAttention's attention dropout)" in err
    with ddpkit.Runtime(device="cpu", seed=0, invariant_dropout=False) as rt:
        assert type(rt.setup(nn.Sequential(nn.Dropout(0.5)))[0]) is nn.Dropout
    with ddpkit.Runtime(device="cpu", seed=0, compile={"fullgraph": True}) as rt:
        assert type(rt.unwrap(rt.setup(nn.Sequential(nn.Dropout(0.5))))[0]) is nn.Dropout
    assert "under compile's fullgraph the model keeps torch's dropout" in capsys.readouterr().err


def test_channel_dropout_drops_whole_channels_of_each_sample(source):
    source["micro"] = MicroBatch(4, 4, True, start=0)
    drop = draws.Dropout2d(0.5, "c2")
    drop.source = source["source"]
    per_channel = drop(torch.ones(4, 16, 3, 3)).flatten(2)
    assert ((per_channel == 0).all(2) | (per_channel == 2).all(2)).all()
    assert (per_channel == 0).any() and (per_channel == 2).any()
    unbatched = draws.Dropout1d(0.5, "c1")
    unbatched.source = source["source"]
    out = unbatched(torch.ones(16, 9))  # (C, L): torch's, channel by channel
    assert ((out == 0).all(1) | (out == 2).all(1)).all()


def test_outside_a_loaders_batches_the_ranks_draw_their_own_masks():
    # No micro-batch from rt.loader: rows are keyed by their place here and the rank (each rank
    # draws for its own rows; before, every rank drew the same masks for its first rows).
    state = {"step": 0, "micro": None, "forward": 0}
    masks = []
    for rank in (0, 1):
        drop = ddpkit.Dropout(0.5, "d")
        drop.source = stand_in(state, rank)
        masks.append(drop(torch.ones(8, 64)))
    assert not torch.equal(*masks)


def test_batch_dim_says_which_dimension_holds_the_samples(source, capsys):
    source["micro"] = MicroBatch(4, 4, True, start=0)
    x = torch.ones(4, 4, 30)  # (T, B, C) with T equal to the micro-batch's size
    named = ddpkit.dropout(x, 0.5, site="t", batch_dim=1)
    source["forward"] += 1
    assert torch.equal(named.transpose(0, 1), ddpkit.dropout(x.transpose(0, 1).contiguous(), 0.5, site="t"))
    source["forward"] += 1
    ddpkit.dropout(x, 0.5, site="ambiguous")
    assert "dimensions [0, 1] of its input (4, 4, 30) all have the micro-batch's 4 samples" in capsys.readouterr().err
    # found once, a site keeps its dimension when another one later has the same size
    source["forward"] += 1
    source["micro"] = MicroBatch(3, 3, True, start=0)
    first = ddpkit.dropout(torch.ones(5, 3, 30), 0.5, site="seq")
    source["forward"] += 1
    source["micro"] = MicroBatch(5, 5, True, start=0)
    ddpkit.dropout(torch.ones(5, 5, 30), 0.5, site="seq")
    assert "seq" not in capsys.readouterr().err and first.shape == (5, 3, 30)


def test_runtimes_key_their_own_models_and_a_resume_without_a_seed_keeps_the_saved_one(tmp_path):
    a = ddpkit.Runtime(device="cpu")  # no seed: rank 0 draws the dropout's
    model_a = a.setup(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    b = ddpkit.Runtime(device="cpu")
    model_b = b.setup(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    a.close()  # b's model keeps b's keys
    assert model_b[1].source is b._draws and b._draws.active and not model_a[1].source.active
    b.save_state(tmp_path / "s.pt")
    saved = b._draws.seed()
    b.close()
    c = ddpkit.Runtime(device="cpu")
    c.setup(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    c.load_state(tmp_path / "s.pt")
    assert c._draws.seed() == saved  # the masks go on with the seed they had
    c.close()
    d = ddpkit.Runtime(device="cpu", invariant_dropout=False)
    d.setup(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)))
    d.save_state(tmp_path / "t.pt")  # no seed for draws at all: saved as none, loaded as none
    d.load_state(tmp_path / "t.pt")
    d.close()


class Rows(nn.Module):
    """Each row's dropout mask of ones, as the model's output."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return ddpkit.dropout(torch.ones(len(x), 32) * self.w, 0.5)


def test_a_step_not_taken_still_begins_the_next_forwards_call_numbers_anew():
    # --on-nonfinite skip: no rt.step(). One micro-batch per step (the resident loader tells the
    # Runtime of no new micro-batch) and two per step must give the next batch the same masks.
    data = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None])
    seen = {}
    for micro in (None, 2):
        with ddpkit.Runtime(device="cpu", seed=1) as rt:
            model = rt.setup(Rows())
            loader = rt.loader(data, batch_size=4, shuffle=False, micro_batch_size=micro)
            seen[micro] = torch.cat([model(x).detach() for (x,) in loader])  # never a step
    assert torch.equal(seen[None], seen[2])


def test_inplace_dropout_drops_in_place_and_channels_last_stays_channels_last(source):
    source["micro"] = MicroBatch(4, 4, True, start=0)
    drop = ddpkit.Dropout(0.5, "i")
    drop.source = source["source"]
    expected = drop(torch.ones(4, 50))
    source["forward"] += 1
    inplace = ddpkit.Dropout(0.5, "i", inplace=True)
    inplace.source = source["source"]
    x = torch.ones(4, 50)
    assert inplace(x) is x and torch.equal(x, expected)
    image = torch.ones(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    assert drop(image).is_contiguous(memory_format=torch.channels_last)


class Both(nn.Module):
    """A module's dropout and the functional form, one after the other (the functional form
    named: under torch.compile its caller is a frame of the compiler's after a graph break)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return ddpkit.dropout(self.drop(x * self.w), 0.5, site="after")


@pytest.fixture
def compiler_left_as_found():
    """torch's compiler as it was: its caches and counters are the process's, and the workers
    later tests fork from this process count their graphs from them."""
    from torch._dynamo.utils import counters

    saved = {name: dict(counts) for name, counts in counters.items()}
    yield
    torch._dynamo.reset()
    counters.clear()
    for name, counts in saved.items():
        counters[name].update(counts)


def _compiled_model(compiled: str) -> nn.Module:
    if compiled == "nested Sequentials":
        inner = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.ReLU(), nn.Dropout(0.5)), nn.Linear(32, 32))
        return nn.Sequential(nn.Sequential(nn.Linear(32, 32), inner), nn.Linear(32, 32), nn.Dropout(0.5))
    if compiled == "a Sequential, by the Runtime":
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5))
    return Both()


@pytest.mark.parametrize(
    "compiled", ["by the Runtime", "by the user after setup", "a Sequential, by the Runtime", "nested Sequentials"]
)
@pytest.mark.usefixtures("compiler_left_as_found")
def test_a_compiled_forward_draws_the_eager_forwards_masks_step_after_step(compiled):
    # The draw stays out of compiled graphs (its keys are Python numbers: a graph would bake
    # one step's in), and what keeps it out is made at the first draw, not at import (importing
    # torch's compiler takes a second): in a traced graph, for a model compiled after setup.
    # An nn.Sequential's loop cannot resume after the draw's break: compiled whole it gave no
    # graph at all, so the Runtime compiles the runs of children between its dropouts instead;
    # a Sequential with a dropout of its own inside one, the same way in its turn.
    from ddpkit.strategy import compiled_graphs

    data = torch.utils.data.TensorDataset(torch.ones(24, 32))
    seen, graphs = {}, {}
    for way in ("eager", compiled):
        options = False if way in ("eager", "by the user after setup") else {"backend": "eager"}
        before = compiled_graphs()
        with ddpkit.Runtime(device="cpu", seed=2, compile=options) as rt:
            torch.manual_seed(0)
            model = _compiled_model(compiled)
            names = [name for name, _ in model.named_parameters()]
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
            if way == "by the user after setup":
                model = torch.compile(model, backend="eager")
            outs = []
            for (x,) in rt.loader(data, batch_size=8, shuffle=False):
                out = model(x)
                rt.backward(out.sum())
                rt.step(opt)
                outs.append(out.detach())
            seen[way] = torch.stack(outs)
            assert [name for name, _ in rt.unwrap(model).named_parameters()] == names  # no _orig_mod.
        graphs[way] = compiled_graphs() - before
    masks = seen["eager"] != 0
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])  # a mask per step
    assert torch.equal(seen[compiled], seen["eager"])
    assert graphs["eager"] == 0 and graphs[compiled] > 0
