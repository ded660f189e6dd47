"""`ddpkit bench models`: training throughput of every built-in model on 3 x 32 x 32 images,
and on a GPU how much of the device it uses (MFU).

One process, one device; each model trains through ddpkit's runtime (dataset resident on the
device, `rt.backward`, `rt.step`, SGD) on synthetic CIFAR-shaped images. After warm-up steps,
`repeats` blocks of steps are timed (CUDA events on a GPU) and reported as median and spread of
the step time and samples/s.

FLOPs per sample are counted by torch's FlopCounterMode (`metrics.flops_per_sample`: forward
and backward of one training sample, matmuls and convolutions). Achieved TFLOP/s = FLOPs per
sample x samples/s; MFU = that over the device's dense peak for the precision
(`metrics.peak_tflops`, from the vendor's data sheet: bf16 tensor-core peak under bf16, TF32
under fp32). A CPU has no such peak in ddpkit's table, so MFU is n/a there (achieved TFLOP/s is
still reported). bf16 is the default on CUDA (`--precision`), fp32 on CPU, where bf16 autocast
is only fast on CPUs with AVX-512 BF16 or AMX.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from typing import Any

from .common import cycle

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "samples/s, step time, FLOPs per sample, achieved TFLOP/s and MFU of every built-in model at 32x32"

MODELS = ("lenet", "cnn", "simple-cnn", "fast-cifar", "resnet18")


@dataclass(frozen=True)
class Work:
    image_size: int
    batch_size: int
    precision: str
    channels_last: bool
    steps_per_repeat: int
    warmup_steps: int
    classes: int = 10
    lr: float = 0.01
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated built-in models (default {','.join(MODELS)})"
    )
    parser.add_argument(
        "--batch-size", type=int, default=0, help="samples per step (default 256 on CUDA; 32 on CPU, --quick 8)"
    )
    parser.add_argument(
        "--precision", default="", choices=("", "fp32", "bf16", "fp16"), help="default bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--channels-last", action="store_true", help="NHWC model and batches")


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..errors import UsageError
    from ..launcher import launch
    from ..models import check

    extra, cuda = opts.extra, device == "cuda"
    names = [m.strip() for m in extra.get("models", ",".join(MODELS)).split(",") if m.strip()]
    work = Work(
        image_size=32,
        batch_size=extra.get("batch_size") or (256 if cuda else (8 if opts.quick else 32)),
        precision=extra.get("precision") or ("bf16" if cuda else "fp32"),
        channels_last=bool(extra.get("channels_last")),
        steps_per_repeat=10 if cuda else 1,
        warmup_steps=3 if cuda else (1 if opts.quick else 2),
    )
    for name in names:
        check(name, work.shape, what="--models")
    if not names or work.batch_size < 1:
        raise UsageError("--models must name at least one model and --batch-size must be positive")
    reps = opts.reps(20 if cuda else 10, 2)
    rows = launch(_worker, work, names, device, reps, nproc=1, device=device)[0]
    return _result(work, device, reps, rows)


# -- inside the worker ----------------------------------------------------------------------------


def _worker(work: Work, names: list[str], device: str, reps: int) -> list[dict[str, Any]]:
    from ..data import synthetic

    train = synthetic(work.shape, work.batch_size * 4, work.classes, work.seed).train
    return [_measure(work, name, train, device, reps) for name in names]


def _measure(work: Work, name: str, train: Any, device: str, reps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ..models import build
    from ..observe.metrics import flops_per_sample, peak_tflops, time_calls
    from ..runtime import Runtime

    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with Runtime(
        strategy="single", precision=work.precision, device=device, seed=work.seed, channels_last=work.channels_last
    ) as rt:
        model = build(name, work.shape, work.classes)
        params = sum(p.numel() for p in model.parameters())
        flops = flops_per_sample(model, work.shape, rt.device)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9))
        batches = cycle(rt.loader(train, batch_size=work.batch_size, resident=True))
        last: list[Any] = [None]

        def steps() -> None:
            for _ in range(work.steps_per_repeat):
                x, y = next(batches)
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                rt.step(opt)
                last[0] = loss.detach()

        seconds = time_calls(steps, rt.device, repeats=reps, warmup=work.warmup_steps)
        out = {
            "model": name,
            "parameters": params,
            "flops_per_sample": flops,
            "step_seconds": [s / work.steps_per_repeat for s in seconds],
            "final_loss": last[0].item(),
            "peak_tflops": peak_tflops(rt.device, work.precision),
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "threads": torch.get_num_threads(),
        }
        batches.close()
    return out


# -- assembling the result ------------------------------------------------------------------------


def _result(work: Work, device: str, reps: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    from .common import stats

    models = []
    for row in rows:
        rate = [work.batch_size / s for s in row["step_seconds"]]
        median_rate = statistics.median(rate)
        flops, peak = row["flops_per_sample"], row["peak_tflops"]
        achieved = flops * median_rate / 1e12 if flops else None
        models.append(
            {
                **row,
                "step_ms": stats([s * 1e3 for s in row["step_seconds"]]),
                "samples_per_second": stats(rate),
                "achieved_tflops": achieved,
                "mfu": achieved / peak if achieved is not None and peak else None,
                "loss_finite": math.isfinite(row["final_loss"]),
            }
        )
    return {
        "method": (
            f"one process on {device} ({rows[0]['threads'] if rows else '?'} threads); each model trains through "
            f"ddpkit's Runtime ({work.precision}"
            + (", channels_last" if work.channels_last else "")
            + f", SGD) on synthetic 3x{work.image_size}x{work.image_size} images resident on the device, batch "
            f"{work.batch_size}; {work.warmup_steps} warm-up call(s), then {reps} blocks of {work.steps_per_repeat} "
            "step(s) timed (" + ("CUDA events" if device == "cuda" else "host clock") + "). flops_per_sample: "
            "torch FlopCounterMode, forward + backward of one sample. achieved_tflops = flops_per_sample x median "
            "samples/s; mfu = achieved / the device's dense peak for the precision (metrics.peak_tflops; none for "
            "a CPU)."
        ),
        "work": asdict(work),
        "repeats": reps,
        "peak_tflops": rows[0]["peak_tflops"] if rows else None,
        "mfu_note": None
        if rows and rows[0]["peak_tflops"]
        else "n/a (no GPU peak): ddpkit knows dense peaks of GPUs only",
        "models": models,
    }


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    ms = r["models"]
    med = [m["samples_per_second"]["median"] for m in ms]
    err = [
        [v - m["samples_per_second"]["q1"] for v, m in zip(med, ms)],
        [m["samples_per_second"]["q3"] - v for v, m in zip(med, ms)],
    ]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(ms)), 4.4))
    ax.bar(range(len(ms)), med, yerr=err, capsize=3, color="C0")
    ax.set_yscale("log")
    for i, m in enumerate(ms):
        mfu = f"MFU {100 * m['mfu']:.1f}%" if m["mfu"] is not None else "MFU n/a"
        flops = f"{m['flops_per_sample'] / 1e9:.2f} GFLOP/sample" if m["flops_per_sample"] else "FLOPs n/a"
        ax.annotate(f"{mfu}\n{flops}", (i, m["samples_per_second"]["q3"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(ms)), [m["model"] for m in ms], fontsize=9)
    ax.set_ylabel("samples / s (median, quartiles; log scale)")
    ax.set_ylim(top=max(med) * 4 if med else None)
    w = r["work"]
    ax.set_title(
        f"training throughput at 3x{w['image_size']}x{w['image_size']}, batch {w['batch_size']}, "
        f"{w['precision']} on {record.get('device', '')}" + ("" if r["peak_tflops"] else " (no GPU peak: MFU n/a)"),
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3, which="both")
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for m in result["models"]:
        mfu = f"MFU {100 * m['mfu']:.1f}%" if m["mfu"] is not None else "MFU n/a (no GPU peak)"
        tflops = f"{m['achieved_tflops']:.3f} TFLOP/s" if m["achieved_tflops"] is not None else "TFLOP/s n/a"
        rate, step = m["samples_per_second"]["median"], m["step_ms"]["median"]
        rows.append((m["model"], f"{rate:,.0f} samples/s, {step:.1f} ms/step, {tflops}, {mfu}"))
    return rows
