"""`ddpkit bench workers`: the DataLoader sweep the tutorials do by hand, for datasets that do
not fit in memory as tensors and so are read sample by sample.

The dataset stands in for a file-backed one: every image is a zlib-compressed uint8 record (a
PNG-like file's body), and `__getitem__` does what a torchvision pipeline does per sample:
decode, zero-pad and random-crop (torchvision's RandomCrop(padding=4)), random horizontal flip,
normalize. The sweep crosses
`num_workers` (0, 1, 2, 4 and the core count) with `pin_memory` (on CUDA; on CPU there is no
host-to-device copy for pinning to speed up) and a few batch sizes. Each setting is measured as
samples per second of a whole epoch of `for x, y in loader: x.to(device, non_blocking=True)`
(CUDA waits for the last copy), after one untimed epoch, with `persistent_workers` so the timed
epochs do not pay for starting workers; that start-up (to the first batch) is reported apart.
"""

from __future__ import annotations

import functools
import gc
import random
import time
import warnings
import zlib
from typing import Any

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "DataLoader num_workers x pin_memory x batch size over a per-sample decode+augment dataset"

TIE = 0.03  # settings within 3% of the fastest count as equally fast: the fewest workers wins


class EncodedImages:
    """Compressed uint8 images decoded and augmented one sample at a time (a map-style Dataset).

    Module-level and holding only bytes and ints, so it pickles to worker processes under any
    start method.
    """

    def __init__(
        self, size: int, shape: tuple[int, int, int] = (3, 32, 32), classes: int = 10, seed: int = 0, padding: int = 4
    ):
        import numpy as np

        rng = np.random.default_rng(seed)
        templates = rng.integers(32, 224, (classes, *shape)).astype(np.float32)
        self.labels = [int(v) for v in rng.integers(0, classes, size)]
        self.records = [
            zlib.compress(np.clip(templates[y] + rng.normal(0, 24, shape), 0, 255).astype(np.uint8).tobytes(), 6)
            for y in self.labels
        ]
        self.shape, self.padding = tuple(shape), padding
        self.mean, self.std = 0.5, 0.25

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        import torch.nn.functional as F

        c, h, w = self.shape
        x = torch.frombuffer(bytearray(zlib.decompress(self.records[i])), dtype=torch.uint8).view(c, h, w)
        x = x.float().div_(255.0)
        if self.padding:
            p = self.padding
            # Zero padding, as RandomCrop(padding=4) does. (Reflect padding would also be
            # realistic, but torch splits it over intra-op threads even for one small image,
            # which on a busy machine stalls the main process for milliseconds per sample.)
            x = F.pad(x, (p, p, p, p))
            top, left = random.randrange(2 * p + 1), random.randrange(2 * p + 1)
            x = x[:, top : top + h, left : left + w]
        if random.random() < 0.5:
            x = x.flip(-1)
        return ((x - self.mean) / self.std).contiguous(), self.labels[i]


def add_arguments(parser: Any) -> None:
    parser.add_argument("--samples", type=int, default=0, help="dataset size (default 8192; --quick 1024)")
    parser.add_argument(
        "--batch-sizes", default="", help="comma-separated batch sizes (default 64,256; --quick 32,128)"
    )
    parser.add_argument("--image-size", type=int, default=32, help="images are 3 x SIZE x SIZE (default 32)")


def _worker_counts() -> list[int]:
    from ..core.device import cpu_count

    return sorted({0, 1, 2, 4, cpu_count()})


def _batch_sizes(opts: Any) -> list[int]:
    from ..core import checks

    text = opts.extra.get("batch_sizes") or ("32,128" if opts.quick else "64,256")
    return list(checks.int_list("--batch-sizes", text, "64,256"))


def run(opts: Any, device: str) -> dict[str, Any]:
    import torch

    from ..errors import UsageError
    from .common import stats

    samples = opts.extra.get("samples") or (1024 if opts.quick else 8192)
    size = opts.extra.get("image_size", 32)
    batch_sizes = _batch_sizes(opts)
    if samples < max(batch_sizes) or size < 1:
        raise UsageError(
            f"--samples {samples} must hold at least one batch of {max(batch_sizes)}, and --image-size be positive"
        )
    dataset = EncodedImages(samples, (3, size, size))
    dev = torch.device(device)
    pins = [False, True] if dev.type == "cuda" else [False]
    epochs = opts.reps(8, 2)
    rows = []
    for batch in batch_sizes:
        for workers in _worker_counts():
            for pin in pins:
                rows.append(
                    {
                        "batch_size": batch,
                        "num_workers": workers,
                        "pin_memory": pin,
                        **_measure(dataset, batch, workers, pin, dev, epochs),
                    }
                )
    per_sample = _per_sample_seconds(dataset, 300 if opts.quick else 2000)
    best = _best(rows)
    return {
        "method": (
            "samples/s of whole epochs of `for x, y in loader: x.to(device, non_blocking=True)` (CUDA waits for "
            "the last copy) after one untimed epoch; DataLoader(shuffle=True, drop_last=True, "
            "persistent_workers=num_workers > 0), so timed epochs reuse the workers; first_batch_seconds is "
            "iter() to the first batch on the device, worker start-up included. Dataset: zlib-compressed "
            "uint8 images decoded per sample, zero-padded by 4 and randomly cropped, randomly flipped and "
            "normalized in __getitem__ (a file-backed pipeline's per-sample work)."
        ),
        "dataset": {
            "samples": samples,
            "shape": [3, size, size],
            "record_bytes_mean": sum(map(len, dataset.records)) / samples,
            "per_sample_seconds": stats(per_sample),
        },
        "device": device,
        "num_workers": _worker_counts(),
        "batch_sizes": batch_sizes,
        "pin_memory": pins,
        "pin_memory_note": None
        if dev.type == "cuda"
        else "n/a on CPU: pinned memory only speeds up host-to-GPU copies; only pin_memory=False was measured",
        "epochs": epochs,
        "results": rows,
        "best": best,
        "best_per_batch_size": {str(b): _best([r for r in rows if r["batch_size"] == b]) for b in batch_sizes},
        "tie_rule": f"the highest median samples/s; settings within {TIE:.0%} of it are ties, broken towards fewer "
        "workers (fewer processes, less memory)",
    }


def _to_device(batch: Any, device: Any) -> Any:
    return [t.to(device, non_blocking=True) for t in batch]


def _epoch(loader: Any, device: Any) -> None:
    for b in loader:
        _to_device(b, device)


def _measure(dataset: Any, batch: int, workers: int, pin: bool, device: Any, epochs: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from ..observe.metrics import sync, time_calls
    from .common import stats

    with warnings.catch_warnings():  # more workers than cores is a point of the sweep, not a mistake
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(0),
        )
        start = time.perf_counter()
        batches = iter(loader)
    _to_device(next(batches), device)
    sync(device)
    first = time.perf_counter() - start
    for b in batches:  # the rest of the untimed first epoch
        _to_device(b, device)

    one_epoch = functools.partial(_epoch, loader, device)
    seconds = time_calls(one_epoch, device, repeats=epochs, warmup=0)
    per_epoch = len(loader) * batch
    del one_epoch, batches, loader  # shuts the persistent workers down before the next setting starts its own
    gc.collect()
    return {
        "samples_per_second": stats([per_epoch / s for s in seconds]),
        "first_batch_seconds": first,
        "samples_per_epoch": per_epoch,
    }


def _per_sample_seconds(dataset: Any, n: int) -> list[float]:
    """What one `dataset[i]` costs in this process: the work the workers take off it."""
    times = []
    for i in range(n):
        t = time.perf_counter()
        dataset[i % len(dataset)]
        times.append(time.perf_counter() - t)
    return times


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    top = max(r["samples_per_second"]["median"] for r in rows)
    ties = [r for r in rows if r["samples_per_second"]["median"] >= (1 - TIE) * top]
    pick = min(ties, key=lambda r: (r["num_workers"], -r["samples_per_second"]["median"]))
    return {
        "num_workers": pick["num_workers"],
        "pin_memory": pick["pin_memory"],
        "batch_size": pick["batch_size"],
        "samples_per_second": pick["samples_per_second"]["median"],
        "first_batch_seconds": pick["first_batch_seconds"],
    }


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, batch in enumerate(r["batch_sizes"]):
        for pin in r["pin_memory"]:
            rows = sorted(
                (x for x in r["results"] if x["batch_size"] == batch and x["pin_memory"] == pin),
                key=lambda x: x["num_workers"],
            )
            xs = [x["num_workers"] for x in rows]
            med = [x["samples_per_second"]["median"] for x in rows]
            err = [
                [m - x["samples_per_second"]["q1"] for m, x in zip(med, rows)],
                [x["samples_per_second"]["q3"] - m for m, x in zip(med, rows)],
            ]
            label = f"batch {batch}" + (f", pin_memory={pin}" if len(r["pin_memory"]) > 1 else "")
            ax.errorbar(
                xs, med, yerr=err, marker="o", capsize=3, color=f"C{i}", linestyle="--" if pin else "-", label=label
            )
    best = r["best"]
    ax.plot(
        [best["num_workers"]],
        [best["samples_per_second"]],
        marker="*",
        markersize=16,
        color="gold",
        markeredgecolor="black",
        linestyle="none",
        label="recommended",
    )
    ax.set_xlabel("num_workers")
    ax.set_xticks(r["num_workers"])
    ax.set_ylabel("samples / s (median, quartiles)")
    ax.set_title(f"DataLoader throughput to {r['device']}: decode + crop + flip + normalize per sample", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    best = result["best"]
    base = next(
        x
        for x in result["results"]
        if x["batch_size"] == best["batch_size"] and x["num_workers"] == 0 and x["pin_memory"] is False
    )
    setting = f"num_workers={best['num_workers']}, pin_memory={best['pin_memory']} (batch {best['batch_size']})"
    speeds = f"{best['samples_per_second']:,.0f} vs {base['samples_per_second']['median']:,.0f}"
    rows = [
        ("recommended", setting),
        ("samples/s recommended vs num_workers=0", speeds),
        ("first batch (worker start-up included)", f"{best['first_batch_seconds'] * 1e3:.0f} ms"),
        ("one sample's __getitem__ (median)", f"{result['dataset']['per_sample_seconds']['median'] * 1e6:.0f} us"),
    ]
    return rows
