"""Paired, alternating measurements, shared by `overhead` and `parity`: the median of the
per-round values, a bootstrap interval of that median, and the verdict on a target.

A round runs both loops once, in an order swapped every round, so whatever else the machine
does at that moment weighs on both: the per-round difference (or ratio) cancels most of the
drift that makes separate runs disagree by several percent.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

MET, NOT_MET, NOT_RESOLVED = "met", "not met", "not resolved"
STATUSES = (MET, NOT_MET, NOT_RESOLVED)
# Below this many rounds a percentile bootstrap of the median takes only a handful of distinct
# values, and its "95%" interval can be narrow by chance: no verdict then.
MIN_ROUNDS = 10


def bootstrap_median(
    values: list[float], resamples: int = 4000, seed: int = 0, groups: list[int] | None = None
) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of `values`. With `groups` (one label
    per value), a two-level bootstrap: the groups resampled, then the values within each."""
    rng = random.Random(seed)
    by_group: dict[int, list[float]] = {}
    for value, group in zip(values, groups or [0] * len(values)):
        by_group.setdefault(group, []).append(value)
    members = list(by_group.values())

    def resample() -> list[float]:
        chosen = rng.choices(members, k=len(members)) if len(members) > 1 else members
        return [v for m in chosen for v in rng.choices(m, k=len(m))]

    medians = sorted(statistics.median(resample()) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdict(low: float, high: float, target: float, resolution: float) -> str:
    """'met', 'not met' or 'not resolved' for "the value is at most `target`", from a 95% interval.

    An interval wider than `resolution` is 'not resolved' whichever side of the target it lies
    on: it cannot tell apart two values `resolution` apart (for a ratio target of 1.01, "costs
    nothing" 1.00 from "costs 1%" 1.01), which is what the measurement is for. A narrower one is
    'met' when it lies at or below the target, 'not met' when wholly above it, and 'not
    resolved' when it straddles the target.
    """
    if high - low > resolution:
        return NOT_RESOLVED
    if high <= target:
        return MET
    return NOT_MET if low > target else NOT_RESOLVED


def paired_ratio(hand: list[float], kit: list[float], target: float, resolution: float | None = None) -> dict[str, Any]:
    """Per-round ratios kit / hand of a cost (seconds per step), their median, its 95% interval
    and the verdict on `target` (a ratio like 1.01; the resolution asked is `target - 1` unless
    given: see `verdict`)."""
    ratios = [k / h for h, k in zip(hand, kit)]
    low, high = bootstrap_median(ratios)
    enough = len(ratios) >= MIN_ROUNDS
    return {
        "ratio": statistics.median(ratios),
        "interval95": [low, high],
        "width": high - low,
        "status": verdict(low, high, target, target - 1.0 if resolution is None else resolution)
        if enough
        else NOT_RESOLVED,
        "ratio_per_round": ratios,
    }
