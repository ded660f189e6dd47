"""`rt.gather` and `rt.evaluate(metrics=, outputs=)`: every sample once, in dataset order, on
any world size (uneven shares, ranks with more batches than others, a rank with no sample),
and metrics equal to a plain one-process computation. One job per world size runs every check
(tests/workers_gather.py); the unit tests check the same rules without processes."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.runtime.gather import Collector, _reference
from tests import workers_gather as wg


def plain(n: int) -> dict:
    """What one process computes without ddpkit: the forward over the whole set, in order."""
    x, y, _ = wg.indexed(n).tensors
    with torch.no_grad():
        out = wg.regressor()(x)
    return {"x": x, "y": y, "out": out, "mse": F.mse_loss(out, y).item(), "mae": wg.mae(out, y).mean().item()}


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_gather_and_evaluate_give_every_sample_once_in_dataset_order(nproc):
    out = ddpkit.launch(wg.gather_checks, nproc=nproc, device="cpu")
    assert len(out) == nproc
    for n, _ in wg.CASES:
        ref = plain(n)
        if nproc > 1 and n > nproc:  # the case gives ranks different batch counts
            assert len({r["batches"][n] for r in out.values()}) > 1
        for r in out.values():
            got = r["gathered"][n]
            assert torch.equal(got["collected"]["x"], ref["x"])
            assert torch.equal(got["collected"]["i"][0], torch.arange(n))
            assert got["collected"]["i"][1] == [f"sample {k}" for k in range(n)]
            assert torch.equal(got["whole"], torch.arange(n))
            for strategy in ("ddp", "fsdp"):
                ev = r["evaluate"][strategy, n]
                assert "accuracy" not in ev and ev["samples"] == n  # regression: no accuracy
                assert ev["loss"] == pytest.approx(ref["mse"], rel=1e-12, abs=0)
                assert ev["squared"] == pytest.approx(ref["mse"], rel=1e-12, abs=0)
                assert ev["mae"] == pytest.approx(ref["mae"], rel=1e-12, abs=0)
                assert torch.equal(ev["outputs"]["target"], ref["y"])
                torch.testing.assert_close(ev["outputs"]["pred"], ref["out"], rtol=1e-12, atol=0)
    if nproc > 1:  # an empty share: rank 2 of 3 holds nothing of 2 samples
        assert nproc < 3 or out[2]["batches"][2] == 0
    _check_errors(out, nproc)


def _check_errors(out: dict, nproc: int) -> None:
    for r in out.values():
        errors = r["errors"]
        assert "metric 'mean' returned shape () for a batch of" in errors["metric"]
        if nproc == 1:  # one rank: any count fits, and no other rank to differ from
            assert errors["partial"] is None and errors["dtype"] is None
            continue
        assert "rt.gather: the ranks passed [" in errors["partial"]
        assert "each rank must pass its values for its whole rt.eval_loader share" in errors["partial"]
        assert f"rt.gather: rank {nproc - 1} passed {{('i',): a torch.int32 tensor" in errors["dtype"]


@pytest.mark.unit
def test_strided_layout_is_checked_before_anything_is_placed():
    skel = {"i": torch.zeros(0)}
    assert _reference([(skel, 6, []), (skel, 5, [])]) is skel
    assert _reference([(skel, 1, []), (skel, 1, []), (None, 0, [])]) is skel  # an empty share
    for counts in ([5, 6], [4, 5], [6, 4], [0, 1]):
        with pytest.raises(ddpkit.UsageError, match=r"the ranks passed \[.*gives them"):
            _reference([(skel, c, []) for c in counts])


@pytest.mark.unit
def test_collector_joins_batches_and_keeps_the_structure():
    Pair = namedtuple("Pair", "pred words")
    seen = Collector()
    assert seen.values() is None
    seen.add(Pair(torch.tensor([[1.0], [2.0]], requires_grad=True), ["a", "b"]))
    seen.add(Pair(torch.tensor([[3.0]]), ["c"]))
    with ddpkit.Runtime(device="cpu") as rt:
        got = rt.gather(seen)
    assert isinstance(got, Pair) and not got.pred.requires_grad
    assert torch.equal(got.pred, torch.tensor([[1.0], [2.0], [3.0]])) and got.words == ["a", "b", "c"]
    seen.add(Pair(torch.tensor([[4]]), ["d"]))  # another dtype
    with pytest.raises(ddpkit.UsageError, match="batch 2's values are not shaped like batch 0's"):
        seen.values()


@pytest.mark.unit
@pytest.mark.parametrize(
    "values,message",
    [
        (3, "not a value of type int"),
        ({"a": torch.tensor(1.0)}, "not a 0-d tensor"),
        ({"a": torch.zeros(3), "b": [1]}, r"one value per sample; they hold \{\('a',\): 3, \('b',\): 1\}"),
        ({}, "no tensor and no list"),
    ],
)
def test_gather_refuses_what_is_not_per_sample(values, message):
    with ddpkit.Runtime(device="cpu") as rt, pytest.raises(ddpkit.UsageError, match=message):
        rt.gather(values)


@pytest.mark.unit
def test_evaluate_reports_what_fits_the_model():
    data = torch.utils.data.TensorDataset(*wg.indexed(7).tensors[:2])
    with ddpkit.Runtime(device="cpu") as rt:
        model = rt.setup(wg.regressor())
        bare = rt.evaluate(model, data, batch_size=3, metrics={"mae": wg.mae})  # no loss_fn, float targets
        assert set(bare) == {"samples", "mae"}
        with pytest.raises(ddpkit.UsageError, match="metric names .* are taken"):
            rt.evaluate(model, data, metrics={"loss": wg.mae})
        with pytest.raises(ddpkit.UsageError, match=r"outputs\(\) returned 1 values for a batch of 3 samples"):
            rt.evaluate(model, data, batch_size=3, outputs=lambda o, y: o[:1])


@pytest.mark.unit
def test_a_language_models_logits_are_not_read_as_classes_at_dimension_1():
    from ddpkit.runtime.evaluation import is_classification

    tokens = torch.zeros(4, 7, dtype=torch.long)
    assert is_classification(torch.zeros(4, 11, 7), tokens)  # cross-entropy's layout
    assert not is_classification(torch.zeros(4, 7, 11), tokens)  # (B, T, V): classes last
    assert is_classification(torch.zeros(4, 10), torch.zeros(4, dtype=torch.long))
