"""`ddpkit bench loader`: samples/s of the device-resident loader against the DataLoader path.

Both read the same uint8 images (MNIST-shaped 1x28x28 by default) in the same global order
and hand out normalized float batches on the device; with augmentation, both crop (after
2-pixel padding) and flip every sample exactly alike (the keys come from seed, epoch and
position). The resident path gathers a batch by index on the device and augments it there in
one go; the DataLoader path calls `__getitem__` per sample, collates, and copies to the
device (pinned, non-blocking on CUDA), with 0 workers (ddpkit's CPU default) and with workers.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

from ..core import checks
from .common import BenchOptions, stats

if TYPE_CHECKING:
    from .. import data

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "device-resident loader vs DataLoader path: samples/s at batch 256, plain and augmented"


def add_arguments(parser: Any) -> None:
    parser.add_argument("--shape", default="1,28,28", help="C,H,W of the images (default 1,28,28)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--samples", type=int, default=0, help="dataset size (default 60000; 8192 with --quick)")


def _images(shape: tuple[int, ...], n: int) -> data.ImageSet:
    import torch

    from .. import data

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return data.ImageSet(images, labels, mean=127.5, std=73.9)


def _rate(make: Any, batches: int, device: str) -> float:
    """Samples/s of reading `batches` batches from a fresh loader, after one warm-up pass
    (worker start-up is not timed); the loader and its workers are shut down afterwards so
    they cannot slow down the next measurement."""
    import gc
    import time

    from ..observe.metrics import sync

    loaders = [make()]

    def read() -> int:
        n = 0
        for _, y in itertools.islice(loaders[0], batches):
            n += len(y)
        sync(device)
        return n

    read()
    t = time.perf_counter()
    n = read()
    rate = n / (time.perf_counter() - t)
    loaders.clear()
    gc.collect()
    return rate


def _same_batches(a: data.DistributedLoader, b: data.DistributedLoader, count: int = 3) -> bool:
    import torch

    for (xa, ya), (xb, yb) in itertools.islice(zip(a, b), count):
        if not (torch.equal(xa.cpu(), xb.cpu()) and torch.equal(ya.cpu(), yb.cpu())):
            return False
    return True


def run(opts: BenchOptions, device: str) -> dict[str, Any]:
    import torch

    from .. import data

    shape = checks.shape("--shape", opts.extra.get("shape", "1,28,28"))
    batch = checks.positive("--batch-size", int(opts.extra.get("batch_size", 256)))
    n = checks.positive("--samples", int(opts.extra.get("samples") or (8192 if opts.quick else 60000)))
    # two copies of the set (one per pipeline): refused now rather than an allocation traceback
    checks.memory(f"--samples {n} images of --shape {opts.extra.get('shape', '1,28,28')}", 2 * n * math.prod(shape))
    repeats = opts.reps(default=5, quick=2)
    dev = torch.device(device)
    batches = max(4, min(n // batch, 16 if opts.quick else 40))
    workers = [0, 2]
    pipelines = {"normalize": None, "crop+flip+normalize": data.Augment(crop_padding=2, flip=True)}
    datasets = {}
    for name, augment in pipelines.items():
        datasets[name] = _images(shape, n)
        datasets[name].augment = augment

    def maker(pipeline: str, resident: bool, num_workers: int = 0) -> Any:
        return lambda: data.train_loader(
            datasets[pipeline],
            batch,
            world_size=1,
            rank=0,
            device=dev,
            seed=0,
            resident=resident,
            num_workers=None if resident else num_workers,
        )

    variants = {}
    for pipeline in pipelines:
        variants[f"resident / {pipeline}"] = maker(pipeline, True)
        for w in workers:
            variants[f"dataloader {w} workers / {pipeline}"] = maker(pipeline, False, w)
    identical = {p: _same_batches(maker(p, True)(), maker(p, False)()) for p in pipelines}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # round robin, so a slow moment of the machine hits every variant
        for name, make in variants.items():
            rates[name].append(_rate(make, batches, device))
    paths = {name: stats(r) for name, r in rates.items()}
    speedups = {}
    for pipeline in pipelines:
        best = max(paths[f"dataloader {w} workers / {pipeline}"]["median"] for w in workers)
        speedups[pipeline] = paths[f"resident / {pipeline}"]["median"] / best
    return {
        "image_shape": list(shape),
        "batch_size": batch,
        "dataset_samples": n,
        "batches_per_pass": batches,
        "repeats": repeats,
        "samples_per_second": paths,
        "identical_batches": identical,
        "speedup_by_pipeline": speedups,
        # the conservative figure: resident vs the best DataLoader setting, worst pipeline
        "speedup": min(speedups.values()),
        "target_speedup": 5.0,
        "meets_target": min(speedups.values()) >= 5.0,
        "method": "median over repeats (round robin over variants) of samples/s reading the same batches from a "
        "fresh loader after a warm-up pass; speedup = resident / the fastest DataLoader setting tried "
        "(0 or 2 workers); the headline is the lower of the two pipelines",
    }


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    names = list(r["samples_per_second"])
    med = [r["samples_per_second"][k]["median"] for k in names]
    lo = [m - r["samples_per_second"][k]["min"] for k, m in zip(names, med)]
    hi = [r["samples_per_second"][k]["max"] - m for k, m in zip(names, med)]
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["tab:green" if k.startswith("resident") else "tab:gray" for k in names]
    ax.barh(names, med, xerr=[lo, hi], color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("samples/s (log scale; bars: median, whiskers: min-max)")
    shape = "x".join(map(str, r["image_shape"]))
    ax.set_title(
        f"loader, {shape} uint8 images, batch {r['batch_size']} on {record['device']}: "
        f"resident is {r['speedup']:.1f}x the best DataLoader"
    )
    ax.invert_yaxis()
    save_figure(fig, path, dpi=100)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(f"speedup, {p}", f"{s:.1f}x") for p, s in result["speedup_by_pipeline"].items()]
    rows.append(("resident batches identical to DataLoader's", str(all(result["identical_batches"].values()))))
    return rows
