"""`metrics`: every `ddpkit train` run reports its step times, memory and FLOPs."""

from __future__ import annotations

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.cli


def test_every_run_reports_throughput_memory_and_flops(tmp_path):
    r, _, out = run_train(tmp_path, "mlp", "--model", "mlp", "--epochs", "2", "--nproc", "2")
    t = r["step_time_ms"]
    assert 0 < t["p50"] <= t["p90"] <= t["p99"]
    assert r["steady_steps"] + r["warmup_steps"] == r["steps"] and r["warmup_steps"] >= 1
    assert len(r["peak_memory_mib"]) == 2 and min(r["peak_memory_mib"]) > 50  # RSS of a torch process
    # mlp on 8x8 digits: 64-30-20-10 linear layers; forward 2 FLOPs per weight, backward twice
    # that, except the first layer's, which needs no gradient for its input
    assert r["flops_per_sample"] == 3 * 2 * (30 * 20 + 20 * 10) + 2 * 2 * 64 * 30
    assert r["achieved_tflops"] == pytest.approx(r["flops_per_sample"] * r["samples_per_second"] / 1e12)
    assert r["mfu"] is None and r["gpu_utilization_percent"] is None  # CPU: no peak, no NVML
