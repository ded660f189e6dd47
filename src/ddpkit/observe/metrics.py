"""Throughput and utilization: step-time percentiles, model FLOPs and MFU, GPU utilization
(memory figures: `core.memory`).

Nothing here synchronizes the device per step: CUDA step ends are recorded as events and
read once, at the end of an epoch, when the loop synchronizes anyway.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Dense peak TFLOP/s per GPU, by precision, from the vendors' data sheets. fp32 training runs
# its convolutions as TF32 on tensor cores by default (cuDNN), so 'fp32' is the TF32 peak.
# Matched by substring of torch.cuda.get_device_name(), first match wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
]


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for `precision` (DDPKIT_PEAK_TFLOPS overrides); None if unknown."""
    override = os.environ.get("DDPKIT_PEAK_TFLOPS")
    if override:
        try:
            return float(override)
        except ValueError:
            print(f"ddpkit: DDPKIT_PEAK_TFLOPS={override!r} is not a number; ignored", file=sys.stderr)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS:
        if key in name:
            return table.get(precision)
    return None


def stamp(cuda: bool) -> Any:
    """A moment of a step: a recorded CUDA event on a GPU (read later, no sync now), else
    `time.perf_counter()` (seconds)."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start: Any, end: Any) -> float:
    """Seconds from one `stamp` to a later one (CUDA events: once the device has passed both)."""
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000.0


class StepTimer:
    """Seconds per optimizer step, without a device sync per step.

    The one timer of steps in ddpkit: the training loop, `time_calls` (the benchmarks and the
    batch-size finder) and the runs' reports all read it.

    `mark(shape)` is called after each step; steps whose input shape was not seen before
    (the first step, a smaller last batch; with torch.compile, the steps that compile for a
    new shape) are warm-up: timed apart and left out of the percentiles. A step's time runs
    from the previous step's end, so logging and checkpoints in between count (in the p99).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steady: list[float] = []
        self.warmup: list[float] = []
        self._seen: set[Any] = set()
        self._pending: list[tuple[Any, bool]] = []  # (end stamp or event, warm-up?)
        self._start: Any = None

    def _stamp(self) -> Any:
        return stamp(self.cuda)

    def start(self) -> None:
        """Before the first step of a pass (time between passes is not a step)."""
        self.flush()
        self._start = self._stamp()

    def mark(self, shape: Any = None) -> None:
        """After a step; `shape` None: never a warm-up step (the caller warmed up already)."""
        self._pending.append((self._stamp(), shape is not None and shape not in self._seen))
        self._seen.add(shape)

    def flush(self) -> None:
        """Turn pending marks into seconds (waits for the device on CUDA)."""
        if self._start is None or not self._pending:
            self._pending = []
            return
        if self.cuda:
            self._pending[-1][0].synchronize()
        prev = self._start
        for moment, warm in self._pending:
            seconds = seconds_between(prev, moment)
            (self.warmup if warm else self.steady).append(seconds)
            prev = moment
        self._start, self._pending = prev, []

    def seconds(self) -> list[float]:
        """Every steady step's seconds so far."""
        self.flush()
        return list(self.steady)

    def summary(self) -> dict[str, Any]:
        self.flush()
        out: dict[str, Any] = {
            "warmup_steps": len(self.warmup),
            "warmup_seconds": sum(self.warmup),
            "steady_steps": len(self.steady),
        }
        if len(self.steady) >= 2:
            q = statistics.quantiles(self.steady, n=100, method="inclusive")
            out["step_time_ms"] = {
                "p50": statistics.median(self.steady) * 1e3,
                "p90": q[89] * 1e3,
                "p99": q[98] * 1e3,
                "mean": statistics.fmean(self.steady) * 1e3,
            }
        elif self.steady:
            v = self.steady[0] * 1e3
            out["step_time_ms"] = {"p50": v, "p90": v, "p99": v, "mean": v}
        return out


def sync(device: Any) -> None:
    """Wait for the device to finish its queued work (a no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds per call of `fn` after `warmup` untimed calls, read by a `StepTimer` (CUDA
    events on a GPU, so the clock covers the device's work without a sync per call)."""
    for _ in range(warmup):
        fn()
    timer = StepTimer(torch.device(device) if isinstance(device, str) else device)
    timer.start()
    for _ in range(repeats):
        fn()
        timer.mark()
    return timer.seconds()


def flops_per_sample(
    model: nn.Module, sample_shape: tuple[int, ...], device: torch.device, vocab: int | None = None
) -> float | None:
    """Floating-point operations of one training sample (forward and backward), counted by
    torch's FlopCounterMode on a copy of the bare model (the run's weights, RNG and
    BatchNorm statistics are left alone). A model of token ids (`vocab` given) gets a
    sequence of `sample_shape` tokens. None when the model cannot be counted."""
    from torch.utils.flop_counter import FlopCounterMode  # 5 ms, only where FLOPs are counted

    try:
        net = copy.deepcopy(model).to(device).train()
        if vocab is None:
            x = torch.randn((2, *sample_shape), device=device)
        else:
            x = torch.randint(0, vocab, (2, *sample_shape), device=device)
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            FlopCounterMode(display=False) as counter,
        ):
            net(x).float().sum().backward()
        return counter.get_total_flops() / 2
    except Exception:  # noqa: BLE001 - an exotic model must not fail the run's report
        return None


class GpuUtilization:
    """Samples the GPU's utilization (NVML, via torch.cuda.utilization) every `period` s in a
    background thread while training runs; `mean()` afterwards. Needs the nvidia-ml-py package."""

    def __init__(self, device: torch.device, period: float = 0.5):
        self.device, self.period, self.samples = device, period, []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            self.error = "not a GPU"
            return
        try:
            torch.cuda.utilization(device)
        except Exception as err:  # noqa: BLE001 - pynvml missing, or NVML unusable
            self.error = f"unavailable ({type(err).__name__}: {err}); pip install nvidia-ml-py"
            return
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddpkit-gpu-util")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:  # noqa: BLE001
                return

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return statistics.fmean(self.samples) if self.samples else None


# ddpkit 0.1's memory readers were here (`ddpkit.metrics.peak_rss_mib`): said to have moved.
MEMORY = (
    "proc_status_mib",
    "peak_rss_mib",
    "reset_peak_rss",
    "rss_mib",
    "available_mib",
    "peak_memory_mib",
    "reset_peak_memory",
)


def __getattr__(name: str) -> Any:
    if name in MEMORY:
        from ..core import memory  # light; only for a caller of the old name

        warnings.warn(f"{__name__}.{name} is now ddpkit.core.memory.{name}", DeprecationWarning, stacklevel=2)
        return getattr(memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
