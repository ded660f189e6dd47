"""`ddpkit bench fast-cifar` as a real command at --quick size: the JSON it writes, and what must hold
of its numbers whatever the machine's speed."""

from __future__ import annotations

import math

import pytest

from ddpkit.bench import fast_cifar
from tests.bench.helpers import positive_stats
from tests.conftest import run_bench


@pytest.mark.unit
def test_time_to_target_counts_training_seconds_up_to_the_first_epoch_reaching_it():
    epochs = [
        {"epoch": 1, "epoch_seconds": 2.0, "test_accuracy": 0.5},
        {"epoch": 2, "epoch_seconds": 1.5, "test_accuracy": 0.95},
        {"epoch": 3, "epoch_seconds": 1.0, "test_accuracy": 0.97},
    ]
    assert fast_cifar.time_to_target(epochs) == {"epoch": 2, "training_seconds": 3.5}
    assert fast_cifar.time_to_target(epochs, target=0.99) is None


@pytest.mark.cli
@pytest.mark.slow
def test_fast_cifar(tmp_path):
    r = run_bench(tmp_path, "fast-cifar")
    assert r["command"][:4] == ["ddpkit", "train", "--model", "fast-cifar"] and "synthetic" in r["command"]
    assert r["synthetic_size"] == 256 and r["global_batch_size"] == 128 and r["steps_per_epoch"] == 2
    assert r["epochs"] == 2 and r["world_size"] == 1 and r["test_samples"] == 51
    assert "label_smoothing: 0.2" in r["config_yaml"] and "augment: crop-flip" in r["config_yaml"]  # the recipe
    (seconds,) = r["epoch_seconds_per_run"]
    assert len(seconds) == 2 and min(seconds) > 0
    assert r["median_epoch_seconds"] == seconds[1] and r["first_epoch_seconds"] == [seconds[0]]  # epoch 1 is warm-up
    assert r["seconds_per_50k_epoch_kind"] == "extrapolated" and "EXTRAPOLATED" in r["method"]
    assert math.isclose(r["seconds_per_50k_epoch"], seconds[1] * 50_000 / 256)
    assert positive_stats(r["samples_per_second"]) and r["step_time_ms"]["p50"] > 0
    assert (
        all(0.0 <= a <= 1.0 for a in r["synthetic_test_accuracy"])
        and "not CIFAR-10" in r["synthetic_test_accuracy_note"]
    )
    (hit,) = r["time_to_target"]  # two epochs at --quick size reach no 94%
    assert r["target_accuracy"] == 0.94 and (hit is None or hit["training_seconds"] <= sum(seconds))
    assert r["peak_memory_kind"] == "rss" and r["flops_per_sample"] > 0 and r["mfu"] is None
