"""`python -m benchmarks plan` as a real command at --quick size on 2 processes: this machine calibrated
(`ddpkit.plan.calibrate`), the plan's step time of ddp, fsdp, fsdp+tp and a pipeline of two
stages beside real steps. What must hold whatever the machine's speed: every figure measured
and positive, the operations counted as the layouts split the model, the ratio that of the two
times. How close they are is the benchmark's record (benchmarks/results/plan-cpu.json), not a
test."""

from __future__ import annotations

import math

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_plan_benchmark_calibrates_here_and_compares_predicted_with_measured(tmp_path):
    r = run_bench(tmp_path, "plan", comparison=True)
    rows = {row["layout"]: row for row in r["rows"]}
    assert set(rows) == {"ddp 2 mb8", "fsdp 2 mb8", "tp 2 mb8", "pp 2 mb2"}
    assert all(row["processes"] == 2 for row in r["rows"])
    assert r["rounds"] == 1 and all(row["round"] == 1 and row["threads"] >= 1 for row in r["rows"])  # --quick
    assert [(s["processes"], s["layout"], s["ratios"]) for s in r["summary"]] == [
        (row["processes"], row["layout"], [row["ratio"]]) for row in r["rows"]
    ]
    assert all(s["rounds_within_goal"] == int(rows[s["layout"]]["within_goal"]) for s in r["summary"])
    for row in r["rows"]:
        assert positive_stats(row["measured_s"])
        assert row["predicted_s"] == pytest.approx(row["predicted_compute_s"] + row["predicted_comm_s"])
        assert row["ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"]["median"])
        assert row["within_goal"] == (abs(row["ratio"] - 1) <= 0.25)
    # the same model's operations, FLOPs by torch's formulas: ddp's rank computes the whole model,
    # fsdp's too (its shards gathered), tp's half of the products on twice the samples
    work = {name: row["work"] for name, row in rows.items()}
    assert work["ddp 2 mb8"]["on_dtensors"] == 0 < work["fsdp 2 mb8"]["on_dtensors"]
    assert work["fsdp 2 mb8"]["flops"] == pytest.approx(work["ddp 2 mb8"]["flops"], rel=0.01)
    assert work["tp 2 mb8"]["on_dtensors"] > 0
    # a pipeline of two stages: its slowest stage's operations, about half of the model's on the
    # same 8 sequences (the split cuts by parameters), none on DTensors
    assert work["pp 2 mb2"]["on_dtensors"] == 0
    assert 0.35 < work["pp 2 mb2"]["flops"] / work["ddp 2 mb8"]["flops"] < 0.65
    cal = r["calibrations"]["2"]
    for figure in ("bytes_per_s", "per_op_s", "attention_flops_per_s", "alpha_s", "link_bytes_per_s"):
        assert math.isfinite(cal[figure]) and cal[figure] > 0, figure
    assert cal["flops_per_s"]["fp32"] > 0 and 0 < cal["efficiency"] <= 1
    assert set(cal["per_dtensor_op_s"]) == {"fsdp", "tp"} and min(cal["per_dtensor_op_s"].values()) >= 0
    kinds = {c["kind"] for c in cal["samples"]["collectives"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter"}
