"""`ddpkit bench strategies` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import pytest

from ddpkit.device import cpu_count
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_strategies(tmp_path):
    r = run_bench(tmp_path, "strategies", "--batch-per-device", "8", "--image-size", "8", "--max-devices", "2")
    assert r["scaling"] == "weak"
    assert set(r["scaling_efficiency"]) == {"single", "ddp"}
    assert "dp" in r["unavailable"] and "GPU" in r["unavailable"]["dp"]
    assert set(r["throughput"]["ddp"]) == {"1", "2"} and set(r["throughput"]["single"]) == {"1"}
    for strategy, by_n in r["scaling_efficiency"].items():
        assert by_n["1"] == 1.0, strategy
        assert all(isinstance(v, float) and v > 0 for v in by_n.values())
    assert r["global_batch"]["ddp"] == {"1": 8, "2": 16}
    assert r["threads_per_process"]["ddp"]["2"] == max(1, cpu_count() // 2)
    assert "| ddp | 2 |" in r["table"]
