"""What every benchmark shares: its options, robust statistics, and writing the JSON (with
the record of where it ran, `env.metadata`) and the plot. Timing is `metrics.time_calls`."""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.files import write_json

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts (the record's metadata among them) load only
# when a benchmark runs.

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


def output_paths(opts: BenchOptions, device: str, draws: bool) -> tuple[str, str | None]:
    """Where the JSON and the plot (None: the benchmark draws none) go: `--json` and `--plot`
    as given. A plot without `--plot` goes beside the JSON (same stem, .png): writing it to
    benchmarks/results/ under the current directory would overwrite a checkout's committed
    plot. Only a run given neither writes there (the documented default)."""
    json_default, plot_default = default_paths(opts.name, device)
    if not draws:
        return opts.json_path or json_default, None
    if opts.plot_path or not opts.json_path:
        return opts.json_path or json_default, opts.plot_path or plot_default
    stem, ext = os.path.splitext(opts.json_path)
    return opts.json_path, (stem if ext.lower() != ".png" else opts.json_path) + ".png"


def cycle(loader: Any) -> Iterator[Any]:
    """A loader's batches, pass after pass, for as many steps as a benchmark times (each pass
    a new epoch of the loader, as a training loop's would be)."""
    while True:
        yield from loader


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
    return {
        "median": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "min": vals[0],
        "max": vals[-1],
        "q1": q[0],
        "q3": q[2],
        "n": len(vals),
    }


def write(
    opts: BenchOptions,
    device: str,
    result: dict[str, Any],
    plot_fn: Callable[[dict, str], None] | None,
    load_before: list[float] | None = None,
) -> dict[str, Any]:
    """Add metadata, write the JSON (and plot), return the full record."""
    from ..observe.env import metadata

    json_path, plot_path = output_paths(opts, device, plot_fn is not None)
    record = {
        "benchmark": opts.name,
        "quick": opts.quick,
        **metadata(device),
        "load_average": {"before": load_before, "after": load_average()},
        "result": result,
    }
    if plot_fn and plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot_fn(record, plot_path)
        record["plot"] = plot_path
    write_json(json_path, record)
    record["json"] = json_path
    return record
