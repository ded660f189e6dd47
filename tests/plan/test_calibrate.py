"""`calibrate._fit`: the collectives' latency and bandwidth fitted to timings, as `ddpkit plan
--gpu cpu` and `python -m benchmarks plan` time them (1 KiB to 4 MiB, each kind over all
processes). The timings here are made from known figures, so the fit can be held to them."""

from __future__ import annotations

import pytest

from ddpkit.plan.calibrate import _fit
from ddpkit.plan.predict import RING

pytestmark = pytest.mark.unit

ALPHA, BANDWIDTH = 50e-6, 1e9  # 50 us per ring step, 1 GB/s


def timings(n: int, slowed: float = 1.0, from_bytes: int = 2**21) -> list[dict]:
    """Each kind's time at each size by the ring model, the largest messages' (from
    `from_bytes`) times `slowed` (a neighbour's load while they were timed)."""
    out = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        steps, wire = RING[kind]
        for size in (2**k for k in range(10, 23)):
            seconds = steps(n) * ALPHA + wire(n) * size / BANDWIDTH
            out.append({"kind": kind, "bytes": size, "seconds": seconds * (slowed if size >= from_bytes else 1.0)})
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_timings_of_the_model_give_its_figures_back(n):
    alpha, bandwidth = _fit(timings(n), n)
    assert alpha == pytest.approx(ALPHA, rel=1e-6) and bandwidth == pytest.approx(BANDWIDTH, rel=1e-6)


@pytest.mark.parametrize("slowed", [1.6, 3.0, 0.5])
def test_the_largest_messages_noise_leaves_the_latency_near_the_small_messages(slowed):
    # Fitted on seconds, the two largest sizes 60% slow made the latency negative (one whole run
    # of the suite measured such a fit: "alpha_s" was no latency at all); on relative errors the
    # small messages, whose time is nearly all latency, keep it.
    alpha, bandwidth = _fit(timings(2, slowed), 2)
    assert 0.8 * ALPHA < alpha < 1.2 * ALPHA
    assert 0.3 * BANDWIDTH < bandwidth < 2.5 * BANDWIDTH


def test_timings_that_fall_with_the_size_still_give_a_latency_and_a_bandwidth():
    # Noise beyond any model (the larger, the quicker): the latency is then the smallest
    # messages' time, and the bandwidth is fitted to what is left
    flipped = timings(2)
    times = sorted(t["seconds"] for t in flipped)
    for t, seconds in zip(sorted(flipped, key=lambda t: t["bytes"]), reversed(times)):
        t["seconds"] = seconds
    alpha, bandwidth = _fit(flipped, 2)
    assert alpha > 0 and 0 < bandwidth < float("inf")


def test_one_process_has_no_collective_to_time():
    assert _fit([], 1) == (0.0, 1e12) and _fit(timings(2), 1) == (0.0, 1e12)
