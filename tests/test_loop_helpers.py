"""What a user's own loop takes beside Runtime's core: DDP's `find_unused_parameters` and
`broadcast_buffers`, `rt.any_rank` and `EarlyStopping` (one stop decision for every rank), and
`EMA` (a hand computation; the same on 1, 2 and 3 processes under ddp and fsdp; fsdp shards saved
and loaded across world sizes and strategies). The distributed cases run in one job per world size
(tests/helpers_workers.py), the 1-process reference in this process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import UsageError
from ddpkit.strategy.ddp import UNUSED_ERROR, UNUSED_HINT
from tests import helpers_workers as hw

# As tests/test_runtime.py: the all-reduce sums in another order than one process, so weights
# may differ in the last float32 bits between world sizes (measured there: below 1e-7).
WORLD_SIZE_ATOL = 1e-6
SIZES = (2, 3)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(folder, the 1-process reference, {nproc: every rank's results of `loop_helpers`})."""
    tmp = tmp_path_factory.mktemp("loop_helpers")
    one = {"ema": hw.ema_steps(str(tmp / "one.pt")), "unused": hw.unused_parameters()}
    launched = {
        n: ddpkit.launch(hw.loop_helpers, str(tmp / f"sharded-{n}"), str(tmp / "one.pt"), nproc=n, device="cpu")
        for n in SIZES
    }
    return tmp, one, launched


@pytest.mark.distributed
def test_unused_parameters_train_with_the_option_and_fail_with_a_hint_without(jobs):
    _, one, launched = jobs
    assert one["unused"]["error"] is None  # one process: no DDP, nothing waits for the spare head
    for n, ranks in launched.items():
        for r, out in ranks.items():
            unused = out["unused"]
            torch.testing.assert_close(unused["weights"], one["unused"]["weights"], rtol=0, atol=WORLD_SIZE_ATOL)
            first, *rest = unused["error"].splitlines()
            assert first == UNUSED_HINT and UNUSED_ERROR in rest[0], (n, r, unused["error"][:300])


@pytest.mark.distributed
def test_broadcast_buffers_gives_every_rank_rank_0s_batchnorm_statistics_or_leaves_each_its_own(jobs):
    for ranks in jobs[2].values():
        on, off = ranks[0]["buffers"][True], ranks[0]["buffers"][False]
        assert all(torch.equal(b, on[0]) for b in on)
        assert not any(torch.equal(b, off[0]) for b in off[1:])  # each rank saw data of its own


@pytest.mark.distributed
def test_an_early_stop_on_one_ranks_view_stops_every_rank_at_the_same_epoch(jobs):
    for n, ranks in jobs[2].items():
        stops = [out["stop"] for out in ranks.values()]
        assert [s["epoch"] for s in stops] == [3] * n  # rank 1's view: no better after epochs 2 and 3
        assert stops[0]["own_bad_checks"] == 0 and stops[1]["own_bad_checks"] == 2  # rank 0 improved all along
        assert all(s["any"] == (True, False) for s in stops)


def hand_ema(snapshots: list[torch.Tensor], decay: float) -> torch.Tensor:
    average = snapshots[0]
    for weights in snapshots[1:]:
        average = decay * average + (1 - decay) * weights
    return average


@pytest.mark.distributed
def test_ema_equals_a_hand_computation_and_is_the_same_on_1_2_and_3_processes(jobs):
    _, one, launched = jobs
    reference = one["ema"]
    assert not reference["sharded"]
    expected = hand_ema(reference["snapshots"], hw.EMA_DECAY)
    assert (expected - reference["snapshots"][-1]).abs().max() > 1e-3  # an average, not the last weights
    torch.testing.assert_close(reference["ema"], expected, rtol=0, atol=WORLD_SIZE_ATOL)
    for ranks in launched.values():
        for out in ranks.values():
            ema = out["ema"]
            assert ema["sharded"]  # fsdp: each rank averages its own shards
            torch.testing.assert_close(ema["ema"], reference["ema"], rtol=0, atol=WORLD_SIZE_ATOL)
            assert torch.equal(ema["reloaded"], ema["ema"])  # its checkpoint directory, read back
            assert torch.equal(ema["loaded"], reference["ema"])  # one process's file, cut into shards
            assert torch.equal(ema["weights"], ema["snapshots"][-1])  # swapping gave the weights back
            ddp = out["unused"]["ema"]  # under ddp: whole on every rank
            torch.testing.assert_close(ddp, one["unused"]["ema"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.distributed
def test_an_ema_saved_in_shards_loads_onto_one_process(jobs):
    tmp, _, launched = jobs
    again = hw.ema_steps(str(tmp / "again.pt"), load_from=str(tmp / "sharded-3"))
    assert torch.equal(again["loaded"], launched[3][0]["ema"]["ema"])


@pytest.mark.unit
@pytest.mark.parametrize(
    "mode,min_delta,values,stops",
    [
        ("min", 0.0, [3.0, 2.0, 2.5, 2.1, 1.0], [False, False, False, True, True]),
        ("min", 0.5, [3.0, 2.6, 2.0, 1.8, 1.6], [False, False, False, False, True]),  # 2.6, 1.8, 1.6: not 0.5 better
        ("max", 0.0, [0.1, 0.5, 0.4, 0.6, 0.6, 0.6], [False, False, False, False, False, True]),
        ("min", 0.0, [1.0, math.nan, math.nan], [False, False, True]),  # NaN never improves
    ],
)
def test_early_stopping_counts_checks_without_improvement(mode, min_delta, values, stops):
    stopper = ddpkit.EarlyStopping(patience=2, min_delta=min_delta, mode=mode)
    assert [stopper.step(v) for v in values] == stops


@pytest.mark.unit
def test_early_stopping_resumes_its_count_from_its_state():
    first = ddpkit.EarlyStopping(patience=3)
    for value in (1.0, 2.0, 2.0):
        first.step(value)
    resumed = ddpkit.EarlyStopping(patience=3)
    resumed.load_state_dict(first.state_dict())
    assert (resumed.best, resumed.bad_checks) == (1.0, 2)
    assert resumed.step(1.5)  # the third check in a row without improvement


@pytest.mark.unit
@pytest.mark.parametrize("kwargs", [{"patience": 0}, {"patience": 2, "min_delta": -1}, {"patience": 2, "mode": "up"}])
def test_early_stopping_refuses_bad_settings(kwargs):
    with pytest.raises(UsageError):
        ddpkit.EarlyStopping(**kwargs)


@pytest.mark.unit
def test_any_rank_on_one_process_is_its_own_flag():
    with ddpkit.Runtime(device="cpu") as rt:
        assert rt.any_rank(True) is True and rt.any_rank(False) is False


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.unit
def test_ema_swaps_its_average_in_and_gives_the_weights_back_even_on_an_exception():
    model = bn_model()
    ema = ddpkit.EMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    with pytest.raises(KeyError), ema.swapped():
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), ema.state_dict().values()))
        assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers))  # buffers: the model's own
        raise KeyError("evaluation failed")
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert list(ema.state_dict()) == [name for name, _ in model.named_parameters()]


@pytest.mark.unit
def test_ema_refuses_a_bad_decay_a_state_of_another_model_and_replaced_parameters():
    model = bn_model()
    for decay in (0.0, 1.0, -0.5, math.nan):
        with pytest.raises(UsageError, match="decay"):
            ddpkit.EMA(model, decay)
    ema = ddpkit.EMA(model, 0.9)
    with pytest.raises(UsageError, match="missing"):
        ema.load_state_dict({"0.weight": torch.zeros(4, 3)})
    with pytest.raises(UsageError, match=r"0.weight is \[4, 4\]"):
        ema.load_state_dict({**ema.state_dict(), "0.weight": torch.zeros(4, 4)})
    model[0].weight = nn.Parameter(torch.zeros(4, 3))  # what fsdp's setup() does to every parameter
    with pytest.raises(UsageError, match="after rt.setup"):
        ema.update()
