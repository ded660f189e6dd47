"""What every benchmark shares: the record of where it ran, robust statistics, timing that
waits for the device, and writing the JSON and plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

RESULTS_DIR = os.path.join("benchmarks", "results")


@dataclass
class BenchOptions:
    """Options every benchmark takes (its own come in `extra`)."""

    name: str
    device: str = "auto"  # auto, cpu or cuda
    repeats: int = 0  # timed repetitions (0: the benchmark's default)
    quick: bool = False  # fewer repetitions and smaller sizes: a smoke run, not a result
    json_path: str | None = None
    plot_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def reps(self, default: int, quick: int = 3) -> int:
        return self.repeats or (quick if self.quick else default)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def device_tag(device: str) -> str:
    """'cpu', or 'cuda-' plus the GPU's name made file-safe ('cuda-nvidia-h100-80gb-hbm3')."""
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_paths(name: str, device: str) -> tuple[str, str]:
    stem = os.path.join(RESULTS_DIR, f"{name}-{device_tag(device)}")
    return stem + ".json", stem + ".png"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(device: str) -> dict[str, Any]:
    """Hardware, software versions and date: recorded with every result file."""
    import torch

    from .. import __version__
    from ..launcher import cpu_count

    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "count": torch.cuda.device_count(), "memory_gib": round(p.total_memory / 2**30, 1),
               "compute_capability": f"{p.major}.{p.minor}", "cuda": torch.version.cuda,
               "cudnn": torch.backends.cudnn.version(),
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": device,
        "cpu": {"model": _cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": cpu_count()},
        "gpu": gpu,
        "memory_gib": _total_memory_gib(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "ddpkit": __version__,
                     "numpy": _version("numpy"), "platform": platform.platform()},
        "git_commit": _git_commit(),
    }


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def _total_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages: other work running beside a benchmark
    explains noisy CPU timings, so every result records them before and after."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def stats(values: list[float]) -> dict[str, Any]:
    """Median and spread of repeated measurements."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0}
    q = statistics.quantiles(vals, n=4) if len(vals) >= 2 else [vals[0]] * 3
    return {"median": statistics.median(vals), "mean": statistics.fmean(vals),
            "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "min": vals[0], "max": vals[-1],
            "q1": q[0], "q3": q[2], "n": len(vals)}


def sync(device: Any) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds per call of `fn`, each timed on its own after `warmup` untimed calls. On CUDA
    the clock reads after the device finished the work (events, not host time)."""
    import torch

    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    cuda = str(device).startswith("cuda")
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def write(opts: BenchOptions, device: str, result: dict[str, Any], plot_fn: Callable[[dict, str], None] | None,
          load_before: list[float] | None = None) -> dict[str, Any]:
    """Add metadata, write the JSON (and plot), return the full record."""
    json_path, plot_path = default_paths(opts.name, device)
    json_path = opts.json_path or json_path
    plot_path = opts.plot_path or (plot_path if plot_fn else None)
    record = {"benchmark": opts.name, "quick": opts.quick, **metadata(device),
              "load_average": {"before": load_before, "after": load_average()}, "result": result}
    if plot_fn and plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot_fn(record, plot_path)
        record["plot"] = plot_path
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, default=str)
    os.replace(tmp, json_path)
    record["json"] = json_path
    return record

