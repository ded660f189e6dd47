"""`ddpkit bench precision`, `comm`, `models` and `fast-cifar` as real commands at --quick sizes:
the JSON they write, and what must hold of their numbers whatever the machine's speed."""

from __future__ import annotations

import math

from ddpkit.bench import comm
from ddpkit.bench.common import BenchOptions

from .conftest import PNG_MAGIC, run_bench

def bench(tmp_path, name: str, *flags: str) -> dict:
    return run_bench(tmp_path, name, *flags)


def positive_stats(s: dict) -> bool:
    return s["n"] >= 1 and 0 < s["min"] <= s["median"] <= s["max"] and math.isfinite(s["max"])


def test_precision(tmp_path):
    r = bench(tmp_path, "precision")
    by = {v["variant"]: v for v in r["variants"]}
    assert set(by) == {"fp32", "fp32+channels_last", "bf16", "bf16+channels_last", "fp16", "fp16+channels_last",
                       "fp32+compile"}
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


def test_comm(tmp_path):
    r = bench(tmp_path, "comm")
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


def test_comm_needs_two_processes(tmp_path):
    """One process (a one-GPU machine) has no all-reduce to measure: reported, drawn, summarized."""
    opts = BenchOptions(name="comm", quick=True, extra={"nproc": 1})
    r = comm.run(opts, "cpu")
    assert r["variants"] == [] and "at least 2 processes" in r["unavailable"]["all"]
    comm.plot({"result": r, "device": "cpu"}, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)
    assert comm.summary(r) == [("all", "unavailable: " + r["unavailable"]["all"])]


def test_models(tmp_path):
    r = bench(tmp_path, "models")
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


def test_fast_cifar(tmp_path):
    r = bench(tmp_path, "fast-cifar")
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
    assert all(0.0 <= a <= 1.0 for a in r["synthetic_test_accuracy"]) and "not CIFAR-10" in r["synthetic_test_accuracy_note"]
    assert r["peak_memory_kind"] == "rss" and r["flops_per_sample"] > 0 and r["mfu"] is None
