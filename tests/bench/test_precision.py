"""`ddpkit bench precision` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import math

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_precision(tmp_path):
    r = run_bench(tmp_path, "precision")
    by = {v["variant"]: v for v in r["variants"]}
    assert set(by) == {
        "fp32",
        "fp32+channels_last",
        "bf16",
        "bf16+channels_last",
        "fp16",
        "fp16+channels_last",
        "fp32+compile",
    }
    # On CPU: one compiled variant, the other skipped with its reason; no cuDNN.
    assert set(r["skipped"]) == {"bf16+compile", "fp32 cudnn.benchmark off"}
    assert "--all-variants" in r["skipped"]["bf16+compile"] and "CUDA" in r["skipped"]["fp32 cudnn.benchmark off"]
    assert by["fp32"]["speedup_vs_fp32"] == 1.0
    for name, v in by.items():
        assert positive_stats(v["step_ms"]) and positive_stats(v["samples_per_second"]), name
        assert v["repeats"] == 1 and len(v["step_seconds"]) == 1  # --repeats 1 is honoured
        assert v["loss_finite"] and math.isfinite(v["final_loss"]), name
        assert v["peak_memory_mib"] is None  # n/a on CPU, never a made-up number
        assert (v["compile_seconds"] is not None) == v["compile"], name
        assert (v["grad_scale"] is not None) == (v["precision"] == "fp16"), name  # fp16 runs a GradScaler
        # Same seed, same first batch: every variant starts from the same loss (bf16/fp16 round it).
        assert abs(v["first_loss"] - by["fp32"]["first_loss"]) < (1e-4 if v["precision"] == "fp32" else 0.05), name
    assert by["fp32+compile"]["compile_seconds"] > 0
    assert r["work"]["batch_size"] == 16 and r["work"]["model"] == "cnn" and "n/a" in r["peak_memory_note"]
