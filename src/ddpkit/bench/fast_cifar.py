"""`ddpkit bench fast-cifar`: the epoch time of the `--model fast-cifar` recipe, measured by
running exactly what a user runs:

    ddpkit train --model fast-cifar --data synthetic --synthetic-shape 3,32,32 \\
                 --synthetic-size N --epochs E --out TMP

as a subprocess (the recipe brings batch 1024, lr 0.4 with a one-epoch warmup, label smoothing,
crop+flip augmentation on the device, and on GPUs bf16 with channels_last; --nproc auto: one
process per GPU). CIFAR-10 itself is not available offline, so the data are synthetic images of
CIFAR-10's shape and size; the test accuracy reported is on that synthetic data -- a sanity
check that the recipe trains, NOT a CIFAR-10 accuracy.

On CUDA N = 50,000: a full CIFAR-10 epoch. On CPU a full epoch takes minutes, so N is a few
hundred to a thousand samples with a smaller batch, and the seconds per 50,000-sample epoch are
extrapolated linearly from the measured epochs (and labelled so). Epoch times come from the
run's metrics.jsonl (`epoch_seconds`: training only, evaluation excluded); the first epoch pays
for warm-up (cuDNN's autotuning, allocator growth, compilation with --compile) and is left out
of the median. Samples/s, step time and peak memory are the run's own results.json. `--repeats`
runs the command that many times; the statistics pool their epochs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "`ddpkit train --model fast-cifar` on CIFAR-shaped synthetic data: seconds per epoch (50k samples on GPU)"

CIFAR10_TRAIN = 50_000
# airbench94's target on CIFAR-10. Here it is reached (or not) on the synthetic data, whose
# classes are easier to tell apart: a time to compare runs of this recipe, not with airbench.
TARGET_ACCURACY = 0.94


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--synthetic-size",
        type=int,
        default=0,
        help="training samples (default 50000 on CUDA; 1024 on CPU, --quick 256)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="epochs per run (default 10 on CUDA, the recipe's; 4 on CPU; --quick 2). The first is warm-up",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="global batch (default: the recipe's 1024 on CUDA; 256 on CPU, --quick 128)",
    )
    parser.add_argument("--compile", action="store_true", help="also pass --compile to ddpkit train")


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..errors import UsageError

    extra, cuda, quick = opts.extra, device == "cuda", opts.quick
    size = extra.get("synthetic_size") or (CIFAR10_TRAIN if cuda else (256 if quick else 1024))
    epochs = extra.get("epochs") or (2 if quick else (10 if cuda else 4))
    batch = extra.get("batch_size") or (None if cuda else (128 if quick else 256))
    if epochs < 2:
        raise UsageError(f"--epochs must be at least 2 (the first epoch is warm-up), got {epochs}")
    if size < 1 or (batch is not None and batch < 1):
        raise UsageError("--synthetic-size and --batch-size must be positive")
    args = [
        "--model",
        "fast-cifar",
        "--data",
        "synthetic",
        "--synthetic-shape",
        "3,32,32",
        "--synthetic-size",
        str(size),
        "--epochs",
        str(epochs),
        "--device",
        device,
    ]
    args += ["--batch-size", str(batch)] if batch else []
    args += ["--compile"] if extra.get("compile") else []
    runs = [_train(args) for _ in range(opts.reps(1, 1))]
    return _result(args, device, size, runs)


def _train(args: list[str]) -> dict[str, Any]:
    """One `ddpkit train` run in a fresh process; its results.json and epoch records."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-fast-cifar-") as out:
        cmd = [sys.executable, "-m", "ddpkit", "train", *args, "--out", out]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # its stderr goes in the error
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"`ddpkit train {' '.join(args)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            epochs = [r for r in map(json.loads, f) if r.get("type") == "epoch"]
        with open(os.path.join(out, "config.yaml")) as f:
            config = f.read()
    return {
        "results": results,
        "epochs": epochs,
        "command_seconds": wall,
        "config_yaml": config,
        "stdout_tail": proc.stdout[-2000:],
    }


def time_to_target(epochs: list[dict[str, Any]], target: float = TARGET_ACCURACY) -> dict[str, Any] | None:
    """The first epoch whose test accuracy reaches `target`, and the training seconds up to its
    end (evaluation excluded); None if no epoch did."""
    seconds = 0.0
    for e in epochs:
        seconds += e["epoch_seconds"]
        if e.get("test_accuracy") is not None and e["test_accuracy"] >= target:
            return {"epoch": e["epoch"], "training_seconds": seconds}
    return None


def _result(args: list[str], device: str, size: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    from .common import stats

    per_run = [[e["epoch_seconds"] for e in run["epochs"]] for run in runs]
    steady = [s for seconds in per_run for s in seconds[1:]]
    median_epoch = statistics.median(steady)
    last = runs[-1]["results"]
    per_50k = median_epoch * CIFAR10_TRAIN / size
    return {
        "method": (
            "runs `ddpkit train " + " ".join(args) + " --out TMP` as a subprocess (what a user runs) "
            f"{len(runs)} time(s); epoch_seconds from metrics.jsonl (training only, evaluation excluded), the first "
            "epoch of each run left out of the median (warm-up); samples_per_second, step_time_ms, peak memory from "
            "results.json. The data are synthetic CIFAR-shaped images (3x32x32, 10 classes): test_accuracy is a "
            "sanity check on that synthetic data, not a CIFAR-10 accuracy."
            + (
                ""
                if size == CIFAR10_TRAIN
                else f" seconds_per_50k_epoch is EXTRAPOLATED linearly from {size}-sample epochs, not measured."
            )
        ),
        "command": ["ddpkit", "train", *args, "--out", "TMP"],
        "synthetic_size": size,
        "test_samples": last["test_samples"],
        "global_batch_size": last["global_batch_size"],
        "steps_per_epoch": last["steps"] // max(1, last["epochs_completed"]),
        "epochs": last["epochs_completed"],
        "world_size": last["world_size"],
        "precision": last["precision"],
        "config_yaml": runs[-1]["config_yaml"],
        "epoch_seconds_per_run": per_run,
        "epoch_seconds": stats(steady),
        "first_epoch_seconds": [seconds[0] for seconds in per_run],
        "median_epoch_seconds": median_epoch,
        "seconds_per_50k_epoch": per_50k,
        "seconds_per_50k_epoch_kind": "measured" if size == CIFAR10_TRAIN else "extrapolated",
        "samples_per_second": stats([r["results"]["samples_per_second"] for r in runs]),
        "step_time_ms_p50": stats(
            [r["results"]["step_time_ms"]["p50"] for r in runs if r["results"].get("step_time_ms")]
        ),
        "step_time_ms": last.get("step_time_ms"),
        "compile_seconds": last.get("compile_seconds"),
        "peak_memory_mib": last.get("peak_memory_mib"),
        "peak_memory_kind": last.get("peak_memory_kind"),
        "flops_per_sample": last.get("flops_per_sample"),
        "mfu": last.get("mfu"),
        "wall_seconds": [r["results"]["wall_seconds"] for r in runs],
        "command_seconds": [r["command_seconds"] for r in runs],
        "synthetic_test_accuracy": [r["results"]["test_accuracy"] for r in runs],
        "target_accuracy": TARGET_ACCURACY,
        "time_to_target": [time_to_target(r["epochs"]) for r in runs],
        "synthetic_test_accuracy_note": "on synthetic CIFAR-shaped data (chance 0.1): a sanity check, not CIFAR-10",
        "stdout_tail": runs[-1]["stdout_tail"],
    }


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, seconds in enumerate(r["epoch_seconds_per_run"]):
        epochs = range(1, len(seconds) + 1)
        ax.plot(epochs, seconds, marker="o", color=f"C{i}", label=f"run {i + 1}")
    ax.axhline(
        r["median_epoch_seconds"],
        color="k",
        linestyle=":",
        label=f"median, epochs 2+: {r['median_epoch_seconds']:.2f} s",
    )
    ax.set_xlabel("epoch (the first is warm-up)")
    ax.set_ylabel("seconds (training, evaluation excluded)")
    ax.set_ylim(0, 1.2 * max(s for seconds in r["epoch_seconds_per_run"] for s in seconds))
    ax.set_xticks(range(1, max(len(s) for s in r["epoch_seconds_per_run"]) + 1))
    kind = r["seconds_per_50k_epoch_kind"]
    ax.set_title(
        f"fast-cifar recipe, {r['synthetic_size']:,} synthetic samples/epoch, batch {r['global_batch_size']}, "
        f"{r['world_size']} x {record.get('device', '')} {r['precision']}\n"
        f"50k-sample epoch: {r['seconds_per_50k_epoch']:.1f} s ({kind})",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    kind = result["seconds_per_50k_epoch_kind"]
    acc = statistics.median(result["synthetic_test_accuracy"])
    return [
        (
            "median epoch (epochs 2+)",
            f"{result['median_epoch_seconds']:.2f} s for {result['synthetic_size']:,} samples",
        ),
        (f"seconds per 50k-sample epoch ({kind})", f"{result['seconds_per_50k_epoch']:.1f} s"),
        (
            "samples/s, step p50",
            (
                f"{result['samples_per_second']['median']:,.0f}, "
                f"{result['step_time_ms_p50'].get('median', float('nan')):.1f} ms"
            ),
        ),
        ("test accuracy, SYNTHETIC data (not CIFAR-10)", f"{acc:.3f}"),
        (f"time to {result['target_accuracy']:.0%}, SYNTHETIC data", _reached(result)),
    ]


def _reached(result: dict[str, Any]) -> str:
    hit = result["time_to_target"][-1]
    if hit is None:
        return f"not reached in {result['epochs']} epochs"
    return f"{hit['training_seconds']:.2f} s of training (epoch {hit['epoch']})"
