"""What must hold of any timing statistics a benchmark reports."""

from __future__ import annotations

import math


def positive_stats(s: dict) -> bool:
    return s["n"] >= 1 and 0 < s["min"] <= s["median"] <= s["max"] and math.isfinite(s["max"])
