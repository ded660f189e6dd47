"""`python -m benchmarks overhead` as a real command (two short rounds), and its interval (over
the rounds, or over the layouts and then the rounds)."""

from __future__ import annotations

import pytest

from benchmarks import overhead
from tests.conftest import run_bench


@pytest.mark.unit
def test_bootstrap_interval_holds_the_median_and_narrows_with_more_rounds():
    few = [float(v) for v in range(10)]
    many = few * 20
    low, high = overhead.bootstrap_median(few)
    assert low <= 4.5 <= high and high - low >= 2
    low_many, high_many = overhead.bootstrap_median(many)
    assert low_many <= 4.5 <= high_many and high_many - low_many < high - low


@pytest.mark.cli
def test_overhead(tmp_path):
    r = run_bench(tmp_path, "overhead", "--rounds", "2", "--steps", "4", comparison=True)
    assert r["weights_equal"] is True  # the three loops made bitwise the same updates
    assert r["rounds"] == 2 and len(r["us_per_step_per_round"]["ddpkit"]) == 2
    for side in overhead.SIDES:
        assert r["us_per_step"][side]["median"] > 0
    low, high = r["overhead_us_interval95"]
    assert low <= r["overhead_us"] <= high
    # the runtime's own bookkeeping, over a hand-written loop gathering as its loader does
    low, high = r["bookkeeping_us_interval95"]
    assert low <= r["bookkeeping_us"] <= high
    assert isinstance(r["meets_target"], bool) and r["target_overhead_us"] == 2.0


@pytest.mark.unit
def test_a_two_level_interval_is_as_wide_as_the_groups_differ():
    # Four layouts whose rounds agree within each but not across: resampling the rounds alone
    # would claim a narrow interval; resampling the layouts too says how far apart they are.
    values = [layout + 0.01 * i for layout in range(4) for i in range(20)]
    groups = [layout for layout in range(4) for _ in range(20)]
    low, high = overhead.bootstrap_median(values)
    low_g, high_g = overhead.bootstrap_median(values, groups=groups)
    assert low_g <= low <= high <= high_g and high_g - low_g > 2 * (high - low)
    same = overhead.bootstrap_median(values, groups=[0] * len(values))
    assert same == (low, high)  # one group: the rounds alone, as before
