"""The loop's per-micro-batch rows and the weights' finiteness check (trainer.tally)."""

from __future__ import annotations

import pytest
import torch

from ddpkit.trainer import tally as tally_module
from ddpkit.trainer.tally import LogSteps, Tally, all_finite

pytestmark = pytest.mark.unit

NAN, INF = float("nan"), float("inf")


def filled(rows: list[tuple[float, int, int, int]], capacity: int = 256) -> Tally:
    tally = Tally(torch.device("cpu"), capacity=capacity)
    for loss, correct, n, step in rows:
        tally.add(torch.tensor(loss, dtype=torch.float32), torch.tensor(correct), n, step)
    return tally


def folded(tally: Tally, first_bad: int = -1, watch: bool = True) -> tuple[list[float], int]:
    sums = torch.zeros(3, dtype=torch.float64)
    bad = torch.tensor(first_bad)
    if watch:
        tally.watch(bad)
    tally.fold(sums)
    return sums.tolist(), int(bad)


def test_the_sums_count_finite_rows_only_and_the_first_bad_step_is_found():
    rows = [(1.5, 3, 4, 1), (2.25, 2, 2, 1), (NAN, 5, 4, 2), (0.5, 1, 4, 3), (INF, 4, 4, 4)]
    tally = filled(rows)
    sums, bad = folded(tally)
    assert sums == [1.5 * 4 + 2.25 * 2 + 0.5 * 4, 3 + 2 + 1, 4 + 2 + 4]
    assert bad == 2
    assert len(tally) == 0  # folded rows are forgotten
    assert folded(tally) == ([0.0, 0.0, 0.0], -1)


def test_a_first_bad_step_already_found_is_kept_and_none_is_not_watched():
    assert folded(filled([(NAN, 1, 2, 7)]), first_bad=3)[1] == 3
    assert folded(filled([(NAN, 1, 2, 7), (1.0, 1, 2, 8)]), watch=False) == ([2.0, 1.0, 2.0], -1)


def test_watching_keeps_the_rows_and_finds_the_first_bad_step_among_all_of_them():
    tally = filled([(1.0, 1, 2, 1), (NAN, 1, 2, 2)])
    bad = torch.tensor(-1)
    tally.watch(bad)
    assert int(bad) == 2 and len(tally) == 2
    tally.add(torch.tensor(INF), torch.tensor(0), 2, 3)
    tally.watch(bad)
    assert int(bad) == 2  # the first one stays


def test_the_step_loss_is_the_last_steps_rows_summed_over_samples_non_finite_included():
    tally = filled([(1.0, 0, 4, 1), (2.0, 0, 4, 2), (3.0, 0, 2, 2)])
    assert tally.step_loss(2).item() == 2.0 * 4 + 3.0 * 2
    assert tally.step_loss(3).item() == 0.0  # a step with no rows on this rank (no samples)
    assert not tally.bad_in(2)
    tally.add(torch.tensor(INF), torch.tensor(0), 2, 3)
    assert tally.step_loss(3).item() == INF
    assert tally.bad_in(3) and not tally.bad_in(4)


def test_rows_beyond_the_capacity_are_all_kept():
    rows = [(float(i), i % 3, 2, i // 2 + 1) for i in range(11)]
    sums, bad = folded(filled(rows, capacity=2))
    assert sums == [sum(2.0 * i for i in range(11)), sum(i % 3 for i in range(11)), 22.0]
    assert bad == -1


def test_a_bf16_loss_is_kept_as_it_was():
    tally = Tally(torch.device("cpu"))
    loss = torch.tensor(1 / 3, dtype=torch.bfloat16)
    tally.add(loss, torch.tensor(1), 3, 1)
    assert tally.step_loss(1).item() == float(loss) * 3


PARAMS = [torch.randn(32, 1, 3, 3), torch.randn(32), torch.randn(128, 1024), torch.randn(10)]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_any_non_finite_element_anywhere_is_seen(bad):
    assert all_finite(PARAMS)
    for which in range(len(PARAMS)):
        params = [p.clone() for p in PARAMS]
        params[which].view(-1)[-1] = bad
        assert not all_finite(params)


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.full((1000,), 3e38)],  # finite, but a float32 sum overflows
        [torch.full((100_000,), 60000.0, dtype=torch.float16)],  # would overflow a float16 sum
        [torch.full((1000,), 3e38, dtype=torch.bfloat16), torch.full((1000,), -3e38, dtype=torch.bfloat16)],
        [torch.full((10,), 1e308, dtype=torch.float64)],
        [],
        [torch.zeros(0)],
    ],
)
def test_large_but_finite_values_are_finite(tensors):
    assert all_finite(tensors)


def test_a_large_sum_and_an_inf_elsewhere_is_still_not_finite():
    assert not all_finite([torch.full((1000,), 3e38), torch.tensor([1.0, -INF])])


def test_log_steps_are_written_in_order_with_their_own_losses_and_only_those_before_a_bad_step():
    logs = LogSteps(every=10)
    logs.add({"type": "step", "step": 10, "loss": None}, torch.tensor(8.0), count=4)
    logs.add({"type": "skip", "step": 13})
    logs.add({"type": "step", "step": 20, "loss": None}, torch.tensor(6.0), count=3)
    assert [loss.item() for loss in logs.losses()] == [8.0, 6.0]
    summed = [16.0, 9.0]  # over two ranks
    assert logs.take(summed) == [
        {"type": "step", "step": 10, "loss": 4.0},
        {"type": "skip", "step": 13},
        {"type": "step", "step": 20, "loss": 3.0},
    ]
    assert logs.records == [] and logs.losses() == []
    logs.add({"type": "step", "step": 30, "loss": None}, torch.tensor(1.0), count=1)
    logs.add({"type": "step", "step": 40, "loss": None}, torch.tensor(NAN), count=1)
    assert [r["step"] for r in logs.take([2.0, NAN], before=35)] == [30]


def test_a_log_step_checks_once_the_interval_has_passed_at_the_steps_pace():
    logs = LogSteps(every=10)
    assert logs.due == 1  # the first log step checks: it measures the pace
    every_s = tally_module.CHECK_EVERY_S
    logs.checked_at(10, seconds=10 * every_s / 100)  # 100 steps per interval, but at most 2 x 10 ahead
    assert logs.due == 10 + 20
    logs.checked_at(30, seconds=20 * every_s / 100)
    assert logs.due == 30 + 40
    logs.checked_at(70, seconds=40 * every_s / 100)
    assert logs.due == 70 + 80
    logs.checked_at(150, seconds=80 * every_s / 100)
    assert logs.due == 150 + 100  # the pace's interval reached
    logs.checked_at(173, seconds=23 * every_s / 200)  # an epoch's end checked: 2 x 23 ahead at most
    assert logs.due == 173 + 46
    logs.checked_at(180, seconds=7 * every_s)  # slow steps: every log step checks
    assert logs.due == 190
    logs.checked_at(180, seconds=5.0)  # no step since: the pace is unknown, the schedule stays
    assert logs.due == 190
    logs.checked_at(190, seconds=10 * every_s / 25)  # 25 steps per interval: the next log step after
    assert logs.due == 190 + 20


def test_a_resumed_run_measures_the_pace_again_from_its_step():
    logs = LogSteps(every=10)
    logs.restart(100_000)
    assert logs.due == 100_001 and logs.checked == 100_000
    logs.checked_at(100_010, seconds=10 * tally_module.CHECK_EVERY_S / 1000)
    assert logs.due == 100_010 + 20  # from the steps since the resume, not since step 0


def test_stamps_on_the_cpu_are_clock_readings_and_their_difference_the_seconds_between():
    from ddpkit.observe.metrics import seconds_between, stamp

    start = stamp(cuda=False)
    assert isinstance(start, float)
    assert seconds_between(start, start + 0.25) == 0.25
    assert 0 <= seconds_between(start, stamp(cuda=False)) < 5


def test_a_records_rate_is_its_samples_over_the_time_between_its_stamps():
    logs = LogSteps(every=10)
    logs.add({"type": "step", "step": 10, "samples_per_second": None}, rate=(640, 100.0, 100.5))
    assert logs.take([]) == [{"type": "step", "step": 10, "samples_per_second": 1280.0}]


def test_rows_are_watched_once_and_their_columns_kept():
    tally = filled([(1.0, 1, 2, 1)] * 3)
    bad = torch.tensor(-1)
    tally.watch(bad)
    assert tally.watched == 3 and int(bad) == -1
    tally.rows[0, 0] = NAN  # a row watched already is not looked at again
    tally.watch(bad)
    assert int(bad) == -1
    tally.add(torch.tensor(NAN), torch.tensor(0), 2, 2)
    tally.watch(bad)
    assert int(bad) == 2 and tally.watched == 4
    assert tally.rows[3].tolist()[1:] == [0.0, 2.0, 2.0]  # correct, count, step


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("bad", [complex(0, NAN), complex(INF, 0), complex(1, -INF)])
def test_complex_tensors_are_finite_only_if_both_parts_are(dtype, bad):
    t = torch.ones(100, dtype=dtype)
    assert all_finite([t])
    t[7] = bad
    assert not all_finite([t])
