"""`ddpkit bench strategies` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import pytest

from ddpkit.core.device import cpu_count
from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_strategies(tmp_path):
    r = run_bench(
        tmp_path,
        "strategies",
        *("--batch-per-device", "8", "--image-size", "8", "--max-devices", "2"),
        *("--mlp-width", "64", "--mlp-depth", "2"),  # the sharded part's MLP, tiny here (default 100.7M)
    )
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
    _check_sharded(r["sharded"])


def _check_sharded(s: dict) -> None:
    assert s["work"]["parameters"] == 2 * (64 * 64 + 64) + 64 * 16 + 16
    configs = s["configs"]
    assert set(configs) == {"single", "ddp", "fsdp", "fsdp2_hand_written", "fsdp2_hand_written_glibc_default"}
    assert set(configs["single"]) == {"1"} and set(configs["ddp"]) == set(configs["fsdp"]) == {"1", "2"}
    assert configs["fsdp"]["1"]["runs_as"] == configs["ddp"]["1"]["runs_as"] == "single"
    assert configs["fsdp"]["2"]["runs_as"] == "fsdp" and configs["ddp"]["2"]["runs_as"] == "ddp"
    for by_n in configs.values():
        for n, m in by_n.items():
            assert m["processes"] == int(n) == len(m["peak_mib"]) == len(m["train_peak_mib"])
            assert all(p >= t > 0 for p, t in zip(m["peak_mib"], m["train_peak_mib"]))
            assert positive_stats(m["step_seconds"])
    assert configs["fsdp"]["2"]["allocator"] == ["mmap threshold 1048576 bytes (mallopt)"]
    assert configs["fsdp2_hand_written"]["2"]["allocator"] == configs["fsdp"]["2"]["allocator"]
    assert configs["ddp"]["2"]["allocator"] == configs["fsdp2_hand_written_glibc_default"]["2"]["allocator"]
    ratio = s["fsdp_ddp_peak_ratio"]
    assert ratio["target"] == 0.6 and ratio["value"] == max(configs["fsdp"]["2"]["peak_mib"]) / max(
        configs["ddp"]["2"]["peak_mib"]
    )
    timing = s["fsdp_vs_hand_written"]
    assert timing["target"] == 1.01 and timing["ratio"] > 0 and timing["cpu_ratio"] > 0
    assert positive_stats(timing["fsdp_step_seconds"]) and positive_stats(timing["hand_written_step_seconds"])
    assert "| fsdp | 2 | fsdp |" in s["table"]
