"""The search of `ddpkit find-batch-size`, as pure logic: which sizes to try and which one to
recommend. The trial function does the work (see `probe`), so this part is tested without it.

The search doubles from `--start` until a size does not fit or `--max-batch` is reached, then
bisects between the last size that fitted and the first that did not, so the boundary found is
exact. On CUDA the recommendation is the largest size that fits. On CPU nothing runs out of
memory within a sensible bound, and larger batches only trade latency for little throughput,
so the pick is the knee: the smallest size that reaches KNEE_FRACTION of the best throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

KNEE_FRACTION = 0.9  # the knee: the smallest batch reaching 90% of the best throughput seen
PLATEAU_GAIN = 1.05  # a doubling "gains" when it beats the best throughput so far by 5%
CRITERIA = {"largest": "largest that fits", "knee": "knee"}


@dataclass
class Trial:
    """One size tried. Timing and memory are the worst over ranks (the slowest rank sets the
    pace of a DDP step); `failed_ranks` lists the ranks on which this size did not fit."""

    per_device_batch: int
    global_batch: int
    fits: bool
    samples_per_s: float | None = None
    step_ms: float | None = None
    peak_memory_mib: float | None = None
    failed_ranks: list[int] = field(default_factory=list)
    reason: str | None = None
    phase: str = "doubling"  # doubling or bisect


def search(
    trial: Callable[[int, str], Trial], start: int, max_batch: int, plateau: int = 0, smallest: int = 1
) -> list[Trial]:
    """Double from `start` until a size fails or `max_batch` is reached (or, with `plateau`,
    until that many doublings in a row gained nothing); then bisect between the last size that
    fitted (or `smallest` - 1) and the first that failed. Returns every trial, in the order run."""
    trials: list[Trial] = []
    good, bad, size = smallest - 1, None, start
    while True:
        trials.append(trial(size, "doubling"))
        if not trials[-1].fits:
            bad = size
            break
        good = size
        if size >= max_batch or (plateau and _plateaued(trials, plateau)):
            break
        size = min(2 * size, max_batch)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        trials.append(trial(mid, "bisect"))
        good, bad = (mid, bad) if trials[-1].fits else (good, mid)
    return trials


def _plateaued(trials: list[Trial], patience: int) -> bool:
    """True when the last `patience` sizes each failed to beat the best before them by 5%."""
    rates = [t.samples_per_s or 0.0 for t in trials if t.fits]
    if len(rates) <= patience:
        return False
    best_before = max(rates[:-patience])
    return all(r < PLATEAU_GAIN * best_before for r in rates[-patience:])


def largest_fit(trials: list[Trial]) -> Trial | None:
    fits = [t for t in trials if t.fits]
    return max(fits, key=lambda t: t.per_device_batch) if fits else None


def knee(trials: list[Trial], fraction: float = KNEE_FRACTION) -> Trial | None:
    """The smallest size tried whose throughput is at least `fraction` of the best seen."""
    fits = [t for t in trials if t.fits and t.samples_per_s]
    if not fits:
        return None
    best = max(t.samples_per_s for t in fits)  # type: ignore[type-var]
    return min((t for t in fits if t.samples_per_s >= fraction * best), key=lambda t: t.per_device_batch)


def pick(trials: list[Trial], criterion: str) -> Trial | None:
    return largest_fit(trials) if criterion == "largest" else knee(trials)
