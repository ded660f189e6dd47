"""`output`: when nothing fits, the message names the size and the ranks."""

from __future__ import annotations

import pytest

from ddpkit import tune
from ddpkit.tune.output import nothing_fits
from tests.tune.helpers import fake_trial

pytestmark = pytest.mark.unit


def test_nothing_fits_names_the_size_and_the_ranks():
    trials = tune.search(fake_trial(0, []), 2, 8)
    for t in trials:
        t.failed_ranks, t.reason = [1], "out of memory"
    r = tune.summarize(trials, tune.Settings(start=2, max_batch=8), "largest", 2, "cuda")
    assert r["per_device_batch"] is None and r["global_batch"] is None
    assert nothing_fits(r) == "no per-device batch fits on every rank: even 1 did not (out of memory on rank 1)"
