"""`ddpkit bench precision`: what `--precision`, `--channels-last`, `--compile` and cuDNN's
autotuner buy on one device.

Every variant trains a fresh copy of the same model (the same seed, so the same initial weights)
on the same synthetic images, through ddpkit's runtime exactly as `ddpkit train` does: the
dataset resident on the device, `rt.backward`, `rt.step`. The variants:

  fp32, bf16 and fp16 (autocast; fp16 adds a GradScaler), each with and without channels_last;
  fp32 and bf16 under torch.compile;
  on CUDA, fp32 with cudnn.benchmark off (ddpkit turns it on by default there).

Each variant first runs a few warm-up steps, timed one by one on the host clock: the first steps
pay for lazy initialization, cuDNN's algorithm search and, compiled, for compiling the forward
and backward graphs. Compile time is reported as those warm-up steps' time minus as many steady
steps (the median), and kept out of the step statistics. Then `repeats` blocks of steps are
timed (CUDA events on a GPU) and the median and spread of the per-step time reported, with
samples/s and the speedup over fp32 eager. Peak memory is CUDA's max_memory_allocated over the
variant's warm-up and timed steps (the resident dataset, allocated before, included); on CPU the
process's peak RSS cannot be split between variants that ran in one process, so it is n/a.
The loss of the last timed step is reported to show the variant still trains (a finite number).

CPU sizes are small (a short conv net, batch 32): CPU autocast in fp16 runs convolutions
without fast kernels on most CPUs and is ~10-50x slower than fp32, and inductor compiles for
tens of seconds on a few cores. So on CPU only fp32+compile is measured (the other compiled
variant is listed as skipped, with the reason, unless --all-variants), and each variant's timed
steps are capped at about CPU_VARIANT_BUDGET_S (never fewer than MIN_REPEATS repetitions, unless
--repeats asks for fewer).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from .common import cycle

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = (
    "fp32 / bf16 / fp16 (+GradScaler) x channels_last, torch.compile, cudnn.benchmark: step time, speedup, memory"
)

CPU_VARIANT_BUDGET_S = 6.0  # timed seconds per variant on CPU, at most (about)
MIN_REPEATS = 3


@dataclass(frozen=True)
class Work:
    model: str
    image_size: int
    batch_size: int
    steps_per_repeat: int  # optimizer steps in one timed block
    warmup_steps: int  # timed one by one, left out of the statistics
    classes: int = 10
    samples: int = 0  # synthetic training set (several batches, cycled)
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


@dataclass(frozen=True)
class Variant:
    precision: str
    channels_last: bool = False
    compile: bool = False
    cudnn_benchmark: bool | None = None  # None: the runtime's default (on for CUDA)

    @property
    def name(self) -> str:
        parts = [self.precision] + ["channels_last"] * self.channels_last + ["compile"] * self.compile
        return "+".join(parts) + (" cudnn.benchmark off" if self.cudnn_benchmark is False else "")


BASELINE = Variant("fp32")
VARIANTS = (
    BASELINE,
    Variant("fp32", True),
    Variant("bf16"),
    Variant("bf16", True),
    Variant("fp16"),
    Variant("fp16", True),
    Variant("fp32", compile=True),
    Variant("bf16", compile=True),
    Variant("fp32", cudnn_benchmark=False),
)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="", help="built-in model (default: resnet18 on CUDA, cnn on CPU)")
    parser.add_argument(
        "--batch-size", type=int, default=0, help="samples per step (default 256 on CUDA; 32 on CPU, --quick 16)"
    )
    parser.add_argument(
        "--image-size", type=int, default=0, help="synthetic images 3 x SIZE x SIZE (default 32; --quick on CPU 16)"
    )
    parser.add_argument(
        "--all-variants",
        action="store_true",
        help="on CPU also measure bf16+compile (slow to compile) instead of skipping it",
    )


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..core import checks
    from ..launcher import launch
    from ..models import check

    extra, cuda, quick = opts.extra, device == "cuda", opts.quick
    batch = extra.get("batch_size") or (256 if cuda else (16 if quick else 32))
    size = extra.get("image_size") or (16 if quick and not cuda else 32)
    work = Work(
        model=extra.get("model") or ("resnet18" if cuda else "cnn"),
        image_size=size,
        batch_size=batch,
        steps_per_repeat=10 if cuda else 1,
        warmup_steps=3 if cuda else 2,
        samples=batch * 8,
    )
    check(work.model, work.shape)
    checks.positive("--batch-size", work.batch_size)
    measured, skipped = _plan(device, extra.get("all_variants", False))
    reps = opts.reps(20 if cuda else 10, MIN_REPEATS)
    budget = None if cuda else CPU_VARIANT_BUDGET_S
    # One worker process of its own: compiled graphs, inductor's compile workers and CUDA's
    # caching allocator stay out of the process that runs the next benchmark.
    rows = launch(_worker, work, measured, device, reps, budget, nproc=1, device=device)[0]
    return _result(work, device, reps, budget, rows, skipped)


def _plan(device: str, all_variants: bool) -> tuple[list[Variant], dict[str, str]]:
    """(variants to measure, {skipped variant: why})."""
    measured, skipped = [], {}
    for v in VARIANTS:
        if v.cudnn_benchmark is False and device != "cuda":
            skipped[v.name] = "cuDNN (and its autotuner, cudnn.benchmark) is CUDA-only"
        elif v.compile and v.precision != "fp32" and device != "cuda" and not all_variants:
            skipped[v.name] = (
                "inductor compiles for tens of seconds per model on a few CPU cores; one compiled "
                "variant (fp32+compile) is measured on CPU. --all-variants measures it too"
            )
        else:
            measured.append(v)
    return measured, skipped


# -- inside the worker ----------------------------------------------------------------------------


def _worker(work: Work, variants: list[Variant], device: str, reps: int, budget: float | None) -> list[dict[str, Any]]:
    import torch

    from ..data import synthetic

    train = synthetic(work.shape, work.samples, work.classes, work.seed).train
    if device == "cuda":
        train.to(torch.device("cuda", torch.cuda.current_device()))  # resident once, before any variant's peak
    return [_measure(work, v, train, device, reps, budget) for v in variants]


def _measure(work: Work, v: Variant, train: Any, device: str, reps: int, budget: float | None) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ..models import build
    from ..observe.metrics import sync, time_calls
    from ..runtime import Runtime

    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with Runtime(
        strategy="single",
        precision=v.precision,
        device=device,
        seed=work.seed,
        channels_last=v.channels_last,
        compile=v.compile,
        cudnn_benchmark=v.cudnn_benchmark,
    ) as rt:
        model = build(work.model, work.shape, work.classes)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=work.lr, momentum=work.momentum))
        batches = cycle(rt.loader(train, batch_size=work.batch_size, resident=True))
        losses: list[Any] = []

        def steps(n: int) -> None:
            for _ in range(n):
                x, y = next(batches)
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                rt.step(opt)
                losses.append(loss.detach())

        warmup = []
        for _ in range(work.warmup_steps):  # host clock: compilation happens on the host
            sync(rt.device)
            t = time.perf_counter()
            steps(1)
            sync(rt.device)
            warmup.append(time.perf_counter() - t)
        n = reps if budget is None else min(reps, max(MIN_REPEATS, int(budget / (warmup[-1] * work.steps_per_repeat))))
        seconds = time_calls(lambda: steps(work.steps_per_repeat), rt.device, repeats=n, warmup=0)
        out = {
            "variant": v.name,
            **asdict(v),
            "repeats": n,
            "warmup_step_seconds": warmup,
            "step_seconds": [s / work.steps_per_repeat for s in seconds],
            "first_loss": losses[0].item(),
            "final_loss": losses[-1].item(),
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "grad_scale": rt.precision.scaler.get_scale() if rt.precision.scaler else None,
        }
        batches.close()
    if v.compile:
        torch.compiler.reset()  # drop the compiled graphs before the next variant
    return out


# -- assembling the result ------------------------------------------------------------------------


def _result(
    work: Work, device: str, reps: int, budget: float | None, rows: list[dict[str, Any]], skipped: dict[str, str]
) -> dict[str, Any]:
    import statistics

    from .common import stats

    variants = []
    for row in rows:
        step = statistics.median(row["step_seconds"])
        throughput = [work.batch_size / s for s in row["step_seconds"]]
        compile_s = (
            max(0.0, sum(row["warmup_step_seconds"]) - len(row["warmup_step_seconds"]) * step)
            if row["compile"]
            else None
        )
        variants.append(
            {
                **row,
                "step_ms": stats([s * 1e3 for s in row["step_seconds"]]),
                "samples_per_second": stats(throughput),
                "compile_seconds": compile_s,
                "loss_finite": math.isfinite(row["final_loss"]),
            }
        )
    base = next(v for v in variants if v["variant"] == BASELINE.name)["samples_per_second"]["median"]
    for v in variants:
        v["speedup_vs_fp32"] = v["samples_per_second"]["median"] / base
    return {
        "method": (
            "one process; each variant trains a fresh copy of the same model (same seed) on the same synthetic "
            "images resident on the device, through ddpkit's Runtime (autocast forward, GradScaler for fp16, "
            f"SGD lr {work.lr} momentum {work.momentum}). {work.warmup_steps} warm-up steps timed one by one (host "
            f"clock), then blocks of {work.steps_per_repeat} step(s) timed "
            + ("with CUDA events" if device == "cuda" else "with the host clock")
            + "; step time = block / steps, median and quartiles over blocks. compile_seconds = warm-up time minus "
            "as many median steps (compilation happens in the first steps; kept out of the step statistics). "
            "speedup = median samples/s over fp32 eager's. peak_memory_mib: torch.cuda.max_memory_allocated over "
            "the variant (resident dataset included)"
            + ("" if device == "cuda" else " -- n/a on CPU")
            + ". final_loss: the last timed step's loss."
            + (
                f" CPU: timed steps per variant capped at ~{budget:g} s (at least {MIN_REPEATS} blocks)."
                if budget
                else ""
            )
        ),
        "work": asdict(work),
        "repeats": reps,
        "cudnn_benchmark_default": device == "cuda",
        "peak_memory_note": None if device == "cuda" else "n/a on CPU: one process runs every variant",
        "variants": variants,
        "skipped": skipped,
    }


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    names = [v["variant"] for v in r["variants"]] + list(r["skipped"])
    med = [v["samples_per_second"]["median"] for v in r["variants"]]
    err = [
        [m - v["samples_per_second"]["q1"] for m, v in zip(med, r["variants"])],
        [v["samples_per_second"]["q3"] - m for m, v in zip(med, r["variants"])],
    ]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(names)), 4.6))
    color = {"fp32": "C0", "bf16": "C1", "fp16": "C2"}
    bars = ax.bar(range(len(med)), med, yerr=err, capsize=3, color=[color[v["precision"]] for v in r["variants"]])
    for v, bar in zip(r["variants"], bars):
        bar.set_hatch("//" if v["compile"] else "")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in color.values()] + [
        plt.Rectangle((0, 0), 1, 1, fill=False, hatch="//")
    ]
    ax.legend(handles, [*color, "compiled"], fontsize=8, loc="upper right")
    for i, v in enumerate(r["variants"]):
        label = f"{v['speedup_vs_fp32']:.2f}x"
        if v["compile_seconds"] is not None:
            label += f"\ncompile {v['compile_seconds']:.0f} s"
        ax.annotate(label, (i, v["samples_per_second"]["q3"]), ha="center", va="bottom", fontsize=7)
    top = max(med) if med else 1.0
    for j in range(len(med), len(names)):
        ax.annotate("skipped", (j, top * 0.02), ha="center", va="bottom", fontsize=7, rotation=90, color="gray")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("samples / s (median, quartiles)")
    w = r["work"]
    ax.set_title(
        f"{w['model']}, batch {w['batch_size']}, {w['image_size']}x{w['image_size']} on "
        f"{record.get('device', '')} (label: speedup over fp32)",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for v in result["variants"]:
        value = (
            f"{v['samples_per_second']['median']:,.0f} samples/s, {v['step_ms']['median']:.1f} ms/step, "
            f"{v['speedup_vs_fp32']:.2f}x"
        )
        if v["compile_seconds"] is not None:
            value += f", compile {v['compile_seconds']:.1f} s"
        if v["peak_memory_mib"] is not None:
            value += f", peak {v['peak_memory_mib']:,.0f} MiB"
        rows.append((v["variant"], value + ("" if v["loss_finite"] else ", LOSS NOT FINITE")))
    rows += [(name, "skipped: " + why) for name, why in result["skipped"].items()]
    return rows
