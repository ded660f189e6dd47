"""`python -m benchmarks dropout`: a gpt step with no dropout, torch's and ddpkit's, through the
real command at a tiny size; its committed result is benchmarks/results/dropout-cpu.json."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.cli.helpers import ok
from tests.conftest import PNG_MAGIC, run_comparison

pytestmark = pytest.mark.cli


def test_the_dropout_benchmark_times_each_case_and_says_whether_the_goal_is_met(tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    proc = run_comparison(
        "dropout", "--quick", "--device", "cpu", "--steps", "2", "--batch", "4", "--context", "16",
        "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    ok(proc)
    r = json.loads(out.read_text())["result"]
    assert set(r["cases"]) == {"none", "torch", "ddpkit"} and all(c["n"] == 2 for c in r["cases"].values())
    paired = r["ddpkit_over_torch"]
    assert len(paired["ratio_per_round"]) == 2 and paired["status"] == "not resolved"  # under 10 rounds: no verdict
    assert paired["ratio"] == pytest.approx(statistics.median(paired["ratio_per_round"]))
    assert r["goal_met"] is False
    assert "ddpkit's / torch's, paired" in proc.stdout and png.read_bytes().startswith(PNG_MAGIC)
