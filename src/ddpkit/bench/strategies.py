"""`ddpkit bench strategies`: single, dp and ddp on the same work, throughput and scaling.

Weak scaling, the usual way to report data-parallel efficiency: every device (a GPU, or on CPU a
process) gets the same per-device batch, so N devices train a global batch N times larger, and

    scaling efficiency(N) = throughput(N) / (N x throughput(1))

is 1.0 when adding devices adds throughput linearly (1.0 at N = 1 by definition). `single` runs
on one device only; `ddp` runs N = 1 .. available processes through ddpkit's launcher (on one
process ddpkit runs the bare model, so ddp's N = 1 is the same configuration as single, measured
again); `dp` (nn.DataParallel, one process driving N GPUs) needs at least two CUDA GPUs and is
reported as unavailable otherwise. On CPU, N counts processes, each given cores // N threads
(what the launcher does), so N = 1 already uses every core.

Each repetition times a block of training steps (data, forward, backward, all-reduce, optimizer)
with `time_calls` after a warm-up block; throughput is the global batch times the steps over the
slowest rank's time.

A second part (`sharded`, see `ddpkit.bench.sharded`) puts fsdp beside single and ddp where
sharding matters: a wide MLP of 100M parameters (`--mlp-width`, `--mlp-depth`) with AdamW at
N = 1 and 2, per-rank peak memory and step time, fsdp's step time against a hand-written FSDP2
loop's, and fsdp's peak memory against ddp's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from . import sharded
from .common import cycle

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = (
    "single / dp / ddp throughput and weak-scaling efficiency for N = 1 .. available devices; single / ddp / "
    "fsdp peak memory and step time on a 100M-parameter MLP"
)

STRATEGY_ORDER = ("single", "dp", "ddp")


@dataclass(frozen=True)
class Work:
    model: str = "cnn"
    image_size: int = 32
    classes: int = 10
    batch_per_device: int = 32
    steps: int = 10  # optimizer steps per timed repetition
    lr: float = 0.05
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="cnn", help="built-in model (default cnn)")
    parser.add_argument(
        "--image-size", type=int, default=0, help="synthetic images 3 x SIZE x SIZE (default 32; --quick 16)"
    )
    parser.add_argument(
        "--batch-per-device",
        type=int,
        default=0,
        help="samples per device per step; the global batch is N times this (default 32; --quick 16)",
    )
    parser.add_argument(
        "--max-devices", type=int, default=0, help="largest N (default: every GPU, or on CPU every usable core)"
    )
    parser.add_argument(
        "--mlp-width", type=int, default=0, help="the sharded part's MLP: layer width (default 2048; --quick 512)"
    )
    parser.add_argument(
        "--mlp-depth",
        type=int,
        default=0,
        help="the sharded part's MLP: layers of width x width (default 24, with 2048: 100.7M parameters; --quick 8)",
    )


def run(opts: Any, device: str) -> dict[str, Any]:
    import torch

    from ..core.device import cpu_count
    from ..errors import UsageError
    from ..launcher import launch
    from ..models import check

    extra = opts.extra
    work = Work(
        model=extra.get("model", "cnn"),
        image_size=extra.get("image_size") or (16 if opts.quick else 32),
        batch_per_device=extra.get("batch_per_device") or (16 if opts.quick else 32),
        steps=4 if opts.quick else 10,
    )
    check(work.model, work.shape)
    if work.batch_per_device < 1 or extra.get("max_devices", 0) < 0:
        raise UsageError("--batch-per-device must be positive and --max-devices at least 0")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    available = gpus if device == "cuda" else cpu_count()
    top = min(available, extra.get("max_devices") or available)
    reps = opts.reps(10, 3)

    measured: dict[str, dict[int, dict[str, Any]]] = {"single": {}, "dp": {}, "ddp": {}}
    one = launch(_worker, work, ["single", "ddp"], device, reps, nproc=1, device=device)[0]
    measured["single"][1], measured["ddp"][1] = one["single"], one["ddp"]
    for n in range(2, top + 1):
        measured["ddp"][n] = launch(_worker, work, ["ddp"], device, reps, nproc=n, device=device)[0]["ddp"]
    unavailable: dict[str, str] = {}
    if gpus >= 2:
        measured["dp"][1] = one["single"]  # DataParallel over one GPU is the bare model (ddpkit runs it so)
        for n in range(2, top + 1):
            with _visible_gpus(n):
                measured["dp"][n] = launch(_worker, work, ["dp"], device, reps, nproc=1, device=device)[0]["dp"]
    else:
        del measured["dp"]
        unavailable["dp"] = "nn.DataParallel drives several GPUs from one process: it needs at least 2 CUDA GPUs; " + (
            "this run is on CPU" if device == "cpu" else f"{gpus} is visible"
        )
    result = _result(work, device, available, top, reps, measured, unavailable)
    result["sharded"] = sharded.run(_sharded_work(opts), device, min(top, 2))
    return result


def _sharded_work(opts: Any) -> sharded.Work:
    extra, quick = opts.extra, opts.quick
    return sharded.Work(
        width=extra.get("mlp_width") or (512 if quick else 2048),
        depth=extra.get("mlp_depth") or (8 if quick else 24),
        batch_per_device=extra.get("batch_per_device") or 16,
        warmup=1 if quick else 2,
        steps=3 if quick else 6,
        rounds=opts.reps(6, 2),
        block=2 if quick else 4,
    )


@contextlib.contextmanager
def _visible_gpus(n: int) -> Iterator[None]:
    """Show the launched workers only the first `n` GPUs (DataParallel uses every visible one)."""
    import torch

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = saved.split(",") if saved else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# -- inside the workers ---------------------------------------------------------------------------


def _train_steps(rt: Any, model: Any, opt: Any, batches: Iterator[Any], steps: int) -> None:
    import torch.nn.functional as F

    for _ in range(steps):
        x, y = next(batches)
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(opt)


def _worker(work: Work, names: list[str], device: str, reps: int) -> dict[str, Any]:
    return {name: _measure(work, name, device, reps) for name in names}


def _measure(work: Work, name: str, device: str, reps: int) -> dict[str, Any]:
    """One strategy on this launch's processes: every rank's seconds per repetition."""
    import torch
    from torch.utils.data import TensorDataset

    from ..models import build
    from ..observe.metrics import time_calls
    from ..runtime import Runtime

    with Runtime(strategy=name, device=device, seed=work.seed) as rt:
        devices = rt.world_size * (torch.cuda.device_count() if rt.strategy == "dp" else 1)
        global_batch = work.batch_per_device * devices
        g = torch.Generator().manual_seed(work.seed)
        n = global_batch * 8  # a few steps per epoch: the loader's epoch turn-over is part of the work
        data = TensorDataset(
            torch.randn((n, *work.shape), generator=g), torch.randint(0, work.classes, (n,), generator=g)
        )
        model = build(work.model, work.shape, work.classes)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9))
        batches = cycle(rt.loader(data, batch_size=global_batch, shuffle=True))
        seconds = time_calls(
            lambda: _train_steps(rt, model, opt, batches, work.steps), rt.device, repeats=reps, warmup=1
        )
        batches.close()
        return {
            "runs_as": rt.strategy,
            "processes": rt.world_size,
            "devices": devices,
            "global_batch": global_batch,
            "threads_per_process": torch.get_num_threads(),
            "seconds": rt.gather_objects(seconds),
        }


# -- assembling the result ----------------------------------------------------------------------


def _throughputs(work: Work, m: dict[str, Any]) -> list[float]:
    """Samples per second of every repetition, over the slowest rank's time."""
    return [m["global_batch"] * work.steps / max(per_rank) for per_rank in zip(*m["seconds"])]


def _result(
    work: Work,
    device: str,
    available: int,
    top: int,
    reps: int,
    measured: dict[str, dict[int, Any]],
    unavailable: dict[str, str],
) -> dict[str, Any]:
    from .common import stats

    throughput = {
        s: {str(n): stats(_throughputs(work, m)) for n, m in sorted(by_n.items())} for s, by_n in measured.items()
    }
    efficiency = {}
    for s, by_n in throughput.items():
        base = by_n["1"]["median"]
        efficiency[s] = {n: 1.0 if n == "1" else v["median"] / (int(n) * base) for n, v in by_n.items()}
    result = {
        "method": (
            "weak scaling: every device gets the same per-device batch, so N devices train a global batch of "
            "N x per-device; scaling efficiency(N) = throughput(N) / (N x throughput(1)) of the same strategy. "
            "Each repetition times a block of training steps (data, forward, backward, all-reduce, optimizer "
            "step) after a warm-up block; throughput = global batch x steps / the slowest rank's time. "
            + (
                "N counts processes on CPU, each with cores // N threads."
                if device == "cpu"
                else "N counts GPUs (ddp: one process per GPU; dp: one process, CUDA_VISIBLE_DEVICES limited to N)."
            )
        ),
        "scaling": "weak",
        "unit": "processes" if device == "cpu" else "GPUs",
        "available": available,
        "largest_n": top,
        "work": asdict(work),
        "repeats": reps,
        "throughput": throughput,
        "scaling_efficiency": efficiency,
        "unavailable": unavailable,
        "runs_as": {s: {str(n): m["runs_as"] for n, m in sorted(by_n.items())} for s, by_n in measured.items()},
        "global_batch": {
            s: {str(n): m["global_batch"] for n, m in sorted(by_n.items())} for s, by_n in measured.items()
        },
        "threads_per_process": {
            s: {str(n): m["threads_per_process"] for n, m in sorted(by_n.items())} for s, by_n in measured.items()
        },
        "note": "ddp on one process runs the bare model (ddpkit does not wrap a one-process job in DDP), so ddp's N=1 "
        "is single's configuration measured again: the gap between the two is the measurement's noise.",
    }
    result["table"] = table(result)
    result["warnings"] = [
        f"{s} at N={n}: efficiency {e:.2f} > 1.1 is superlinear; usually throughput(1) was measured too low "
        "(on CPU: its cores // 1 threads competing with other load on the machine)"
        for s, by_n in efficiency.items()
        for n, e in by_n.items()
        if e > 1.1
    ]
    return result


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    if "sharded" in r:
        fig, ((left, right), (memory, steps)) = plt.subplots(2, 2, figsize=(11, 8.4))
        sharded.plot(r["sharded"], memory, steps)
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"single": "s", "dp": "^", "ddp": "o"}
    top = 1
    for s in STRATEGY_ORDER:
        if s not in r["throughput"]:
            continue
        ns = sorted(int(n) for n in r["throughput"][s])
        top = max(top, *ns)
        med = [r["throughput"][s][str(n)]["median"] for n in ns]
        err = [
            [m - r["throughput"][s][str(n)]["q1"] for m, n in zip(med, ns)],
            [r["throughput"][s][str(n)]["q3"] - m for m, n in zip(med, ns)],
        ]
        left.errorbar(ns, med, yerr=err, marker=styles[s], capsize=3, label=s)
        right.plot(ns, [r["scaling_efficiency"][s][str(n)] for n in ns], marker=styles[s], label=s)
    base = r["throughput"]["single"]["1"]["median"]
    left.plot(range(1, top + 1), [base * n for n in range(1, top + 1)], "k:", label="linear")
    left.set_xlabel(f"N ({r['unit']})")
    left.set_ylabel("samples / s (median, quartiles)")
    left.set_title("throughput, per-device batch fixed")
    right.axhline(1.0, color="k", linestyle=":", label="ideal")
    right.set_xlabel(f"N ({r['unit']})")
    right.set_ylabel("throughput(N) / (N x throughput(1))")
    right.set_title("scaling efficiency")
    right.set_ylim(0, max(1.2, *(v for e in r["scaling_efficiency"].values() for v in e.values())) * 1.05)
    for ax in (left, right):
        ax.set_xticks(range(1, top + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    missing = "; ".join(f"{s}: unavailable" for s in r["unavailable"])
    fig.suptitle(
        f"{r['work']['model']} on {record.get('device', '')}, {r['work']['batch_per_device']} samples per device"
        + (f" ({missing})" if missing else ""),
        fontsize=10,
    )
    save_figure(fig, path, dpi=110)


def table(result: dict[str, Any]) -> str:
    """Markdown table: strategy, N, samples/s (median), scaling efficiency."""
    lines = ["| strategy | N | samples/s | efficiency |", "|---|---|---|---|"]
    for s in STRATEGY_ORDER:
        for n, v in result["throughput"].get(s, {}).items():
            lines.append(f"| {s} | {n} | {v['median']:,.0f} | {result['scaling_efficiency'][s][n]:.2f} |")
        if s in result["unavailable"]:
            lines.append(f"| {s} | - | unavailable | {result['unavailable'][s]} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for s in STRATEGY_ORDER:
        for n, v in result["throughput"].get(s, {}).items():
            rows.append(
                (f"{s} N={n} samples/s (efficiency)", f"{v['median']:,.0f} ({result['scaling_efficiency'][s][n]:.2f})")
            )
        if s in result["unavailable"]:
            rows.append((f"{s}", "unavailable: " + result["unavailable"][s]))
    return rows + (sharded.summary(result["sharded"]) if "sharded" in result else [])
