"""`search`: doubling then bisection finds the exact boundary without trying a size twice, copes
with nothing fitting and with a start that is too large, and the knee and the plateau."""

from __future__ import annotations

import itertools

import pytest

from ddpkit import tune
from tests.tune.helpers import fake_trial

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("start", [1, 8])
@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 37, 64, 100, 999, 1000, 5000])
def test_search_finds_the_exact_boundary(start, threshold):
    log: list[int] = []
    trials = tune.search(fake_trial(threshold, log), start, max_batch=1000)
    assert tune.largest_fit(trials).per_device_batch == min(threshold, 1000)
    doubling = [t.per_device_batch for t in trials if t.phase == "doubling"]
    assert doubling[0] == start and all(b == min(2 * a, 1000) for a, b in itertools.pairwise(doubling))
    good = max([b for b in doubling if b <= threshold], default=0)
    assert all(good < t.per_device_batch < doubling[-1] for t in trials if t.phase == "bisect")
    assert len(set(log)) == len(log)  # no size tried twice


def test_search_when_nothing_fits_and_from_a_start_too_large():
    assert tune.largest_fit(tune.search(fake_trial(0, []), 4, 64)) is None
    log: list[int] = []
    trials = tune.search(fake_trial(5, log), 16, 64)
    assert log == [16, 8, 4, 6, 5] and tune.largest_fit(trials).per_device_batch == 5
    log = []  # BatchNorm models start at 2 and never try 1
    assert tune.largest_fit(tune.search(fake_trial(1, log), 2, 64, smallest=2)) is None and log == [2]
    log = []
    assert tune.largest_fit(tune.search(fake_trial(2, log), 8, 64, smallest=2)).per_device_batch == 2
    assert log == [8, 4, 2, 3]


def test_knee_is_the_smallest_size_reaching_90_percent_of_the_best():
    rates = {1: 100.0, 2: 180.0, 4: 700.0, 8: 905.0, 16: 1000.0, 32: 960.0}
    trials = [tune.Trial(b, b, True, samples_per_s=r) for b, r in rates.items()] + [tune.Trial(64, 64, False)]
    assert tune.knee(trials).per_device_batch == 8  # 905 >= 0.9 * 1000; 700 is not
    assert tune.pick(trials, "largest").per_device_batch == 32
    # Plateau: two sizes in a row without 5% gain over the best before them stop the doubling.
    log: list[int] = []
    curve = {1: 10.0, 2: 20.0, 4: 40.0, 8: 41.0, 16: 40.0, 32: 90.0}
    trials = tune.search(
        lambda b, ph: log.append(b) or tune.Trial(b, b, True, samples_per_s=curve[b]), 1, 32, plateau=2
    )
    assert log == [1, 2, 4, 8, 16]
