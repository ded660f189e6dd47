"""`ddpkit bench comm` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed; on one process, reported as unavailable."""

from __future__ import annotations

import math

import pytest

from ddpkit.bench import comm
from ddpkit.bench.common import BenchOptions
from tests.bench.helpers import positive_stats
from tests.conftest import PNG_MAGIC, run_bench


@pytest.mark.cli
@pytest.mark.slow
def test_comm(tmp_path):
    r = run_bench(tmp_path, "comm")
    assert r["nproc"] == 2 and r["backend"] == "gloo" and r["global_batch"] == 2 * r["work"]["batch_per_rank"]
    by = {v["variant"]: v for v in r["variants"]}
    assert set(by) | set(r["unavailable"]) == set(comm.VARIANTS)
    for name, why in r["unavailable"].items():  # only a backend that cannot all-reduce the dtype may refuse
        assert name.startswith("comm_hook=") and "gloo" in why and "Error" in why
    elements = r["gradient_elements"]
    assert 11_000_000 < elements < 11_500_000  # ResNet-18, 10 classes
    default = by["default"]
    for name, v in by.items():
        assert positive_stats(v["step_ms"]), name
        assert v["counted_steps"] == r["repeats"] * r["work"]["steps_per_repeat"]  # the timed steps, counted
        assert v["bytes_per_step_constant"] and v["buckets_per_step"] == len(v["bucket_mb"]) >= 1
        assert v["loss_finite"], name
        if v["wire_dtype"] == "float32":
            # Every fp32 gradient is all-reduced exactly once per step, whatever the buckets.
            assert v["bytes_per_step"] == 4 * elements, name
            # Same seed, same data, same sums (two ranks: a + b is exact): the same training.
            assert math.isclose(v["final_loss"], default["final_loss"], rel_tol=1e-6), name
    for hook in ("comm_hook=fp16", "comm_hook=bf16"):
        if hook in by:
            v = by[hook]
            assert v["wire_dtype"] == hook.split("=")[1].replace("fp", "float").replace("bf16", "bfloat16")
            assert abs(2 * v["bytes_per_step"] - default["bytes_per_step"]) <= 2 * v["buckets_per_step"]
            assert math.isclose(v["bytes_vs_default"], 0.5, rel_tol=1e-6)
    # Smaller buckets, more of them; above the model's size, one.
    buckets = [by[f"bucket_cap_mb={mb}"]["buckets_per_step"] for mb in (1, 5, 100)]
    assert buckets[0] >= buckets[1] >= default["buckets_per_step"] >= buckets[2] == 1
    assert buckets[0] > default["buckets_per_step"]


@pytest.mark.unit
def test_comm_needs_two_processes(tmp_path):
    """One process (a one-GPU machine) has no all-reduce to measure: reported, drawn, summarized."""
    opts = BenchOptions(name="comm", quick=True, extra={"nproc": 1})
    r = comm.run(opts, "cpu")
    assert r["variants"] == [] and "at least 2 processes" in r["unavailable"]["all"]
    comm.plot({"result": r, "device": "cpu"}, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)
    assert comm.summary(r) == [("all", "unavailable: " + r["unavailable"]["all"])]
