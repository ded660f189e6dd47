"""A trial that fits up to a threshold, for the tests of the search."""

from __future__ import annotations

from ddpkit import tune


def fake_trial(fits_up_to: int, log: list[int]):
    def trial(size: int, phase: str) -> tune.Trial:
        log.append(size)
        ok = size <= fits_up_to
        return tune.Trial(size, 2 * size, ok, samples_per_s=float(size) if ok else None, phase=phase)

    return trial
