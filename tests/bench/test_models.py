"""`ddpkit bench models` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import math

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_models(tmp_path):
    r = run_bench(tmp_path, "models")
    by = {m["model"]: m for m in r["models"]}
    assert set(by) == {"lenet", "cnn", "simple-cnn", "fast-cifar", "resnet18"}
    assert r["work"]["image_size"] == 32 and r["work"]["precision"] == "fp32"
    assert r["peak_tflops"] is None and "n/a" in r["mfu_note"]
    for name, m in by.items():
        assert positive_stats(m["samples_per_second"]) and positive_stats(m["step_ms"]), name
        assert m["flops_per_sample"] > 0 and m["achieved_tflops"] > 0 and m["mfu"] is None, name
        assert m["loss_finite"] and m["peak_memory_mib"] is None, name
        rate = m["samples_per_second"]["median"]
        assert math.isclose(m["achieved_tflops"], m["flops_per_sample"] * rate / 1e12, rel_tol=1e-9)
    flops = {name: m["flops_per_sample"] for name, m in by.items()}
    assert flops["resnet18"] == max(flops.values()) and flops["resnet18"] > flops["fast-cifar"] > flops["cnn"]
    # CIFAR ResNet-18 is 0.56 G multiply-adds forward: x2 FLOPs, x3 with backward.
    assert 3.2e9 < flops["resnet18"] < 3.5e9
    assert 11_000_000 < by["resnet18"]["parameters"] < 11_500_000
