"""`ddpkit find-batch-size`: the largest per-device batch that fits, and the throughput curve.

Each size is one trial of real training steps (forward, backward, optimizer step under DDP) on
a synthetic batch of that many samples per process. The search doubles from `--start` until a
size does not fit or `--max-batch` is reached, then bisects between the last size that fitted
and the first that did not, so the boundary found is exact.

Out-of-memory on one rank must not leave the others waiting in a collective. DDP all-reduces
gradients inside backward (and may broadcast buffers inside forward), so a rank that fails
half-way through a DDP step strands its peers there. A trial therefore runs in two phases:

1. probe: one forward and backward of the bare module, not the DDP wrapper (no collectives at
   all), with out-of-memory caught and the memory released on the rank where it happens;
2. agree: one all-reduce of a per-rank failure code; every rank sees the same verdict, and only
   if every rank fitted do all of them run the timed DDP steps.

So every rank runs the same sequence of collectives whatever happens on any one of them, and
the size chosen fits on every rank (the minimum over ranks).

Which size to recommend: on CUDA the largest that fits. On CPU nothing runs out of memory
within a sensible bound, and larger batches only trade latency for little throughput, so the
pick is the knee: the smallest size that reaches KNEE_FRACTION of the best throughput seen.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from .errors import UsageError
from .metrics import peak_rss_mib, proc_status_mib, reset_peak_rss

KNEE_FRACTION = 0.9  # the knee: the smallest batch reaching 90% of the best throughput seen
PLATEAU_GAIN = 1.05  # a doubling "gains" when it beats the best throughput so far by 5%
CPU_MEMORY_HEADROOM = 0.8  # a CPU trial may use at most this share of the available memory
CRITERIA = {"largest": "largest that fits", "knee": "knee"}

# What a rank reports for a trial in the agreement all-reduce (0: it fitted).
OOM, PREDICTED = 1, 2
REASONS = {OOM: "out of memory", PREDICTED: "predicted to exceed available memory"}


@dataclass(frozen=True)
class Settings:
    """What one search runs; checked here so bad input fails before any worker starts."""

    model: str = "cnn"
    data: str = "digits"
    in_shape: tuple[int, ...] = (1, 8, 8)
    num_classes: int = 10
    device: str = "auto"
    precision: str = "fp32"
    optimizer: str = "sgd"
    start: int = 1
    max_batch: int = 65536
    steps: int = 5
    warmup: int = 2
    criterion: str = "auto"  # auto (largest on CUDA, knee on CPU), largest or knee
    plateau: int = 2  # knee search: stop doubling after this many sizes in a row without gain
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        from . import models

        for flag, value in (("--start", self.start), ("--max-batch", self.max_batch), ("--steps", self.steps),
                            ("--num-classes", self.num_classes)):
            if value < 1:
                raise UsageError(f"{flag} must be a positive integer, got {value}")
        if self.start > self.max_batch:
            raise UsageError(f"--start {self.start} is larger than --max-batch {self.max_batch}")
        if self.warmup < 0 or self.plateau < 0:
            raise UsageError(f"--warmup and --plateau must be >= 0, got {self.warmup} and {self.plateau}")
        try:
            models.check(self.model, self.in_shape)
        except ValueError as err:
            raise UsageError(f"--model {self.model}: {err}") from None

    def resolved_criterion(self, device_type: str) -> str:
        if self.criterion != "auto":
            return self.criterion
        return "largest" if device_type == "cuda" else "knee"


@dataclass
class Trial:
    """One size tried. Timing and memory are the worst over ranks (the slowest rank sets the
    pace of a DDP step); `failed_ranks` lists the ranks on which this size did not fit."""

    per_device_batch: int
    global_batch: int
    fits: bool
    samples_per_s: float | None = None
    step_ms: float | None = None
    peak_memory_mib: float | None = None
    failed_ranks: list[int] = field(default_factory=list)
    reason: str | None = None
    phase: str = "doubling"  # doubling or bisect


# -- the search (pure logic: the trial function does the work) --------------------------------


def search(trial: Callable[[int, str], Trial], start: int, max_batch: int, plateau: int = 0,
           smallest: int = 1) -> list[Trial]:
    """Double from `start` until a size fails or `max_batch` is reached (or, with `plateau`,
    until that many doublings in a row gained nothing); then bisect between the last size that
    fitted (or `smallest` - 1) and the first that failed. Returns every trial, in the order run."""
    trials: list[Trial] = []
    good, bad, size = smallest - 1, None, start
    while True:
        trials.append(trial(size, "doubling"))
        if not trials[-1].fits:
            bad = size
            break
        good = size
        if size >= max_batch or (plateau and _plateaued(trials, plateau)):
            break
        size = min(2 * size, max_batch)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        trials.append(trial(mid, "bisect"))
        good, bad = (mid, bad) if trials[-1].fits else (good, mid)
    return trials


def _plateaued(trials: list[Trial], patience: int) -> bool:
    """True when the last `patience` sizes each failed to beat the best before them by 5%."""
    rates = [t.samples_per_s or 0.0 for t in trials if t.fits]
    if len(rates) <= patience:
        return False
    best_before = max(rates[:-patience])
    return all(r < PLATEAU_GAIN * best_before for r in rates[-patience:])


def largest_fit(trials: list[Trial]) -> Trial | None:
    fits = [t for t in trials if t.fits]
    return max(fits, key=lambda t: t.per_device_batch) if fits else None


def knee(trials: list[Trial], fraction: float = KNEE_FRACTION) -> Trial | None:
    """The smallest size tried whose throughput is at least `fraction` of the best seen."""
    fits = [t for t in trials if t.fits and t.samples_per_s]
    if not fits:
        return None
    best = max(t.samples_per_s for t in fits)  # type: ignore[type-var]
    return min((t for t in fits if t.samples_per_s >= fraction * best), key=lambda t: t.per_device_batch)


def pick(trials: list[Trial], criterion: str) -> Trial | None:
    return largest_fit(trials) if criterion == "largest" else knee(trials)


# -- one trial on one rank ----------------------------------------------------------------------


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator's RuntimeError that says it ran out."""
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Tuner:
    """Runs trials on one rank: probe, agree, then the timed DDP steps.

    `probe_hook(rank, per_device_batch)` runs at the start of every probe, inside the
    out-of-memory handling; tests use it to make one rank fail above a size.
    """

    def __init__(self, rt: Any, settings: Settings, probe_hook: Callable[[int, int], None] | None = None):
        import torch
        import torch.nn.functional as F

        from . import models

        self.rt, self.s, self.hook, self.F = rt, settings, probe_hook, F
        model = models.build(settings.model, settings.in_shape, settings.num_classes)
        if settings.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, nesterov=True)
        # BatchNorm cannot train on one sample where its input is 1x1 (one value per channel).
        batchnorms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
        self.smallest = 2 if any(isinstance(m, batchnorms) for m in model.modules()) else 1
        self.model, self.opt = rt.setup(model, opt)
        # The probe runs the module inside DDP (with its autocast, if any): no collectives.
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self.bare = self.model.module if ddp else self.model
        self._allocate_optimizer_state()
        self.cuda = rt.device.type == "cuda"
        self.base_rss = _rss_mib()
        self.last_fit: tuple[int, float] | None = None  # (size, this rank's peak) of the last fit
        self.local: dict[int, str] = {}  # what this rank alone saw: size -> reason it failed here

    def _allocate_optimizer_state(self) -> None:
        """One optimizer step on zero gradients, the same on every rank: momentum (or Adam's
        moments) then exists before the first probe, which so measures a steady-state step."""
        for p in self.bare.parameters():
            p.grad = p.detach().new_zeros(p.shape)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def batch(self, n: int) -> tuple[Any, Any]:
        import torch

        device = self.rt.device
        return (torch.randn((n, *self.s.in_shape), device=device),
                torch.randint(0, self.s.num_classes, (n,), device=device))

    def __call__(self, size: int, phase: str) -> Trial:
        import torch

        code = self.probe(size)
        if code:
            self.local[size] = REASONS[code]
        world = self.rt.world_size
        codes = torch.zeros(world, dtype=torch.float32, device=self.rt.device)
        codes[self.rt.rank] = code
        self.rt.all_reduce(codes)  # the agreement: every rank learns every rank's verdict
        failed = [r for r in range(world) if codes[r] > 0]
        if failed:
            reason = REASONS[int(codes[failed[0]].item())]
            return Trial(size, size * world, False, failed_ranks=failed, reason=reason, phase=phase)
        step_s, peak = self.timed(size)
        self.last_fit = (size, peak)
        worst = torch.tensor([step_s, peak], dtype=torch.float64, device=self.rt.device)
        self.rt.all_reduce(worst, op="max")
        step_s, peak = worst.tolist()
        return Trial(size, size * world, True, samples_per_s=size * world / step_s, step_ms=1000 * step_s,
                     peak_memory_mib=round(peak, 1), phase=phase)

    def probe(self, size: int) -> int:
        """0 if one forward and backward of `size` samples fits on this rank, else a reason code."""
        if self._predicted_too_big(size):
            return PREDICTED
        self._reset_peak()
        try:
            self._probe_step(size)
            code = 0
        except Exception as err:  # anything but out-of-memory is re-raised
            if not is_oom(err):
                raise
            code = OOM
        # Outside the except block: the exception (and the frames holding the batch and the
        # activations) is gone by now, so the memory can actually be released.
        self.opt.zero_grad(set_to_none=True)
        self._release(collect=code == OOM)
        return code

    def _probe_step(self, size: int) -> None:
        if self.hook is not None:
            self.hook(self.rt.rank, size)
        x, y = self.batch(size)
        self.rt.backward(self.F.cross_entropy(self.bare(x), y))

    def timed(self, size: int) -> tuple[float, float]:
        """(median seconds per DDP step, this rank's peak memory in MiB) over the timed steps."""
        try:
            times = self._time_steps(size)
        except Exception as err:
            if is_oom(err):  # the peers are inside the DDP step: this run cannot go on
                raise RuntimeError(f"out of memory in the DDP step at per-device batch {size}, after a probe of "
                                   f"that size fitted; rerun with --max-batch {max(1, size - 1)}") from None
            raise
        peak = self._peak_mib()
        self._release()
        return statistics.median(times), peak

    def _time_steps(self, size: int) -> list[float]:
        from .bench.common import time_calls

        x, y = self.batch(size)  # one batch, reused: the timing is of the step, not of data

        def step() -> None:
            self.rt.backward(self.F.cross_entropy(self.model(x), y))
            self.rt.step(self.opt)

        return time_calls(step, self.rt.device, repeats=self.s.steps, warmup=self.s.warmup)

    # -- memory ---------------------------------------------------------------------------------
    def _reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        else:
            reset_peak_rss()

    def _peak_mib(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated(self.rt.device) / 2**20
        return peak_rss_mib()

    def _release(self, collect: bool = False) -> None:
        """Hand freed memory back. Tensors die with their last reference; a full collection
        (a quarter of a second with torch loaded) is for after a failure, in case something
        on the failed path formed a reference cycle."""
        import torch

        if collect:
            gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def _predicted_too_big(self, size: int) -> bool:
        """CPU only: whether `size` would need more than the memory the machine has left,
        extrapolated linearly from the last size that fitted. On Linux the alternative is not
        an exception to catch but the kernel's OOM killer ending the worker."""
        if self.cuda or self.last_fit is None:
            return False
        fitted, peak = self.last_fit
        predicted = self.base_rss + (peak - self.base_rss) * size / fitted
        growth = (predicted - _rss_mib()) * self.rt.env.local_world_size  # every local rank grows alike
        available = _available_mib()
        return available is not None and growth > CPU_MEMORY_HEADROOM * available


def _rss_mib() -> float:
    return proc_status_mib("VmRSS") or 0.0


def _available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


# -- the worker -----------------------------------------------------------------------------------


def worker(settings: Settings, probe_hook: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The search on this rank; every rank returns the same result, plus what it saw alone."""
    from .log import print0
    from .runtime import Runtime

    with Runtime(strategy="ddp", precision=settings.precision, device=settings.device, seed=0,
                 timeout_s=settings.timeout_s) as rt:
        tuner = Tuner(rt, settings, probe_hook)
        criterion = settings.resolved_criterion(rt.device.type)
        start = max(settings.start, tuner.smallest)
        print0(header(settings, rt.world_size, rt.device.type, rt.strategy))
        if start > settings.start:
            print0(f"(the model has BatchNorm, which trains on 2 samples or more: starting at {start})")
        print0(TABLE_HEADER)

        def trial(size: int, phase: str) -> Trial:
            t = tuner(size, phase)
            print0(row(t))
            return t

        plateau = settings.plateau if criterion == "knee" else 0
        trials = search(trial, start, max(start, settings.max_batch), plateau, tuner.smallest)
        result = summarize(trials, settings, criterion, rt.world_size, rt.device.type)
        result.update(strategy=rt.strategy, rank=rt.rank, local_failures=tuner.local)
        if rt.is_main:
            from .bench.common import metadata

            result.update(metadata(rt.device.type))
        return result


def summarize(trials: list[Trial], settings: Settings, criterion: str, world: int, device: str) -> dict[str, Any]:
    chosen, largest = pick(trials, criterion), largest_fit(trials)
    failed = any(not t.fits for t in trials)
    stop = "did not fit" if failed else ("--max-batch" if largest and largest.per_device_batch >= settings.max_batch
                                         else "plateau")
    best = max((t for t in trials if t.fits), key=lambda t: t.samples_per_s or 0.0, default=None)
    return {
        "per_device_batch": chosen.per_device_batch if chosen else None,
        "global_batch": chosen.global_batch if chosen else None,
        "world_size": world,
        "criterion": CRITERIA[criterion],
        "knee_fraction": KNEE_FRACTION,
        "knee_rule": f"smallest per-device batch tried reaching >= {KNEE_FRACTION:.0%} of the best samples/s seen",
        "largest_fitting_per_device_batch": largest.per_device_batch if largest else None,
        "best_samples_per_s": best.samples_per_s if best else None,
        "best_per_device_batch": best.per_device_batch if best else None,
        "search_stopped_by": stop,
        "trials": [asdict(t) for t in trials],
        "settings": {**asdict(settings), "in_shape": list(settings.in_shape)},
        "peak_memory_measure": "torch.cuda.max_memory_allocated" if device == "cuda" else "process peak RSS (VmHWM)",
    }


# -- output -----------------------------------------------------------------------------------------

TABLE_HEADER = f"{'per-device':>10} {'global':>8} {'samples/s':>11} {'step ms':>9} {'peak MiB':>9}  fits"


def header(s: Settings, world: int, device: str, strategy: str) -> str:
    shape = "x".join(map(str, s.in_shape))
    return (f"ddpkit find-batch-size: {s.model} on {s.data} {shape} ({s.num_classes} classes), {world} x {device} "
            f"{strategy}, {s.precision}, {s.optimizer}; per size: 1 probe step, then {s.warmup} warm-up and "
            f"{s.steps} timed training steps on a synthetic batch")


def row(t: Trial) -> str:
    if not t.fits:
        ranks = ",".join(map(str, t.failed_ranks))
        blank = f"{'-':>11} {'-':>9} {'-':>9}"
        return f"{t.per_device_batch:>10,} {t.global_batch:>8,} {blank}  no: {t.reason}, rank {ranks}"
    return (f"{t.per_device_batch:>10,} {t.global_batch:>8,} {t.samples_per_s:>11,.0f} {t.step_ms:>9.2f} "
            f"{t.peak_memory_mib:>9,.0f}  yes")


def nothing_fits(r: dict[str, Any]) -> str:
    smallest = min(r["trials"], key=lambda t: t["per_device_batch"])
    return (f"no per-device batch fits on every rank: even {smallest['per_device_batch']} did not "
            f"({smallest['reason']} on rank {','.join(map(str, smallest['failed_ranks']))})")


def conclusion(r: dict[str, Any]) -> list[str]:
    """The lines after the table: why this size, and what to pass to `ddpkit train`."""
    b, g, lines = r["per_device_batch"], r["global_batch"], []
    largest = r["largest_fitting_per_device_batch"]
    bad = [t for t in r["trials"] if not t["fits"]]
    if bad:
        first_bad = min(t["per_device_batch"] for t in bad)
        lines.append(f"largest that fits on every rank: per-device {largest:,} (global {largest * r['world_size']:,}); "
                     f"{first_bad:,} did not fit")
    else:
        hint = "; raise it to look further" if r["search_stopped_by"] == "--max-batch" else ""
        lines.append(f"everything tried fitted, up to per-device {largest:,} (search stopped by "
                     f"{r['search_stopped_by']}{hint})")
    if r["criterion"] == "knee":
        lines.append(f"knee: per-device {b:,} is the smallest size reaching >= {r['knee_fraction']:.0%} of the best "
                     f"{r['best_samples_per_s']:,.0f} samples/s (at per-device {r['best_per_device_batch']:,})")
    lines.append(f"use --batch-size {g} (per device {b}) on {r['world_size']} process"
                 f"{'es' if r['world_size'] > 1 else ''} [criterion: {r['criterion']}]")
    return lines


def write_json(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, default=str)
    os.replace(tmp, path)


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput against per-device batch (log2 axis), the pick starred, failures crossed."""
    from .plots import pyplot, save_figure

    plt = pyplot()
    fits = sorted((t for t in result["trials"] if t["fits"]), key=lambda t: t["per_device_batch"])
    bad = [t for t in result["trials"] if not t["fits"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([t["per_device_batch"] for t in fits], [t["samples_per_s"] for t in fits], "o-", label="fits")
    if bad:
        ax.plot([t["per_device_batch"] for t in bad], [0] * len(bad), "rx", markersize=10, label="did not fit")
    if result["criterion"] == "knee" and result["best_samples_per_s"]:
        ax.axhline(result["knee_fraction"] * result["best_samples_per_s"], color="gray", linestyle="--",
                   label=f"{result['knee_fraction']:.0%} of best")
    chosen = next((t for t in fits if t["per_device_batch"] == result["per_device_batch"]), None)
    if chosen:
        ax.plot([chosen["per_device_batch"]], [chosen["samples_per_s"]], "*", color="tab:orange", markersize=16,
                label=f"pick ({result['criterion']}): {chosen['per_device_batch']}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")  # 1, 2, 4 ... rather than 2^0, 2^1 ...
    ax.set_xlabel("per-device batch")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_ylim(bottom=0)
    s = result["settings"]
    ax.set_title(f"{s['model']}, {result['world_size']} x {result.get('device', s['device'])}, {s['precision']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save_figure(fig, path, dpi=100)


# -- the command ------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) <= 0:
        raise UsageError(f"--synthetic-shape must be positive integers like 3,32,32, got {text!r}")
    return dims


def build_parser(parser_cls: Any) -> Any:
    from . import models
    from .data import DATASETS
    from .precision import PRECISIONS
    from .runtime import DEVICES

    p = parser_cls(prog="ddpkit find-batch-size",
                   description="Find the largest per-device batch that fits on every rank (doubling, then "
                               "bisection; out-of-memory caught), with the throughput of each size tried. On CPU "
                               f"the pick is the knee: the smallest size reaching {KNEE_FRACTION:.0%} of the best "
                               "throughput.")
    p.add_argument("--model", default="cnn", choices=list(models.MODELS))
    p.add_argument("--data", default="digits", choices=DATASETS,
                   help="gives the input shape and number of classes; batches are synthetic either way")
    p.add_argument("--synthetic-shape", default="3,32,32", metavar="C,H,W", help="input shape with --data synthetic")
    p.add_argument("--num-classes", type=int, default=10, help="classes with --data synthetic")
    p.add_argument("--nproc", default="auto", help="processes: N, or auto (one per GPU; on CPU one per 4 cores)")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"), help="its state counts in the memory")
    p.add_argument("--start", type=int, help="first per-device batch (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--max-batch", type=int, default=65536, help="largest per-device batch to try (default 65536)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per size (default 5; the median counts)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per size before those (default 2)")
    p.add_argument("--criterion", default="auto", choices=("auto", *CRITERIA),
                   help="which size to recommend: largest (that fits) or knee; auto: largest on CUDA, knee on CPU")
    p.add_argument("--plateau", type=int, default=2,
                   help="knee search: stop doubling after N sizes in a row without 5%% more throughput (0: never)")
    p.add_argument("--json", metavar="FILE", help="write the result and the trials here")
    p.add_argument("--plot", metavar="FILE.png", help="draw throughput against per-device batch here")
    return p


def settings_from(a: Any, device_type: str) -> Settings:
    from .data import shape_of

    in_shape, classes = shape_of(a.data, parse_shape(a.synthetic_shape), a.num_classes)
    # A default start never exceeds a small --max-batch; a --start that does is refused.
    start = a.start if a.start is not None else min(8 if device_type == "cuda" else 1, max(1, a.max_batch))
    return Settings(model=a.model, data=a.data, in_shape=in_shape, num_classes=classes, device=a.device,
                    precision=a.precision, optimizer=a.optimizer, start=start, max_batch=a.max_batch,
                    steps=a.steps, warmup=a.warmup, criterion=a.criterion, plateau=a.plateau)


def local_processes(nproc: int | str, device_type: str) -> int:
    """How many workers to start here; 1 under torchrun / srun, where this process is one."""
    from . import dist
    from .launcher import parse_nproc

    if dist.detect_env().source != "single":
        if str(nproc) not in ("auto", "1"):
            raise UsageError("under torchrun or srun each process is one worker: drop --nproc")
        return 1
    n = parse_nproc(nproc, device_type)
    if device_type == "cuda":
        import torch

        if n > torch.cuda.device_count():
            raise UsageError(f"--nproc {n} is more than the {torch.cuda.device_count()} visible GPUs")
    return n


def run(settings: Settings, nproc: int = 1, probe_hook: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The search here (one process, or one worker under torchrun / srun) or on `nproc`
    launched local workers; returns the result (rank 0's, with the metadata)."""
    from .launcher import launch

    if nproc == 1:
        return worker(settings, probe_hook)
    return launch(worker, settings, probe_hook, nproc=nproc, device=settings.device)[0]


def _check_writable(flag: str, path: str) -> None:
    """Fail now, not after the search, if an output file cannot be written."""
    import tempfile

    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path) or ".", prefix=".tmp-write-test-"):
            pass
    except FileExistsError:
        raise UsageError(f"{flag} {path}: its folder is a file") from None
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write there ({err.strerror})") from None


def cli_main(argv: Sequence[str], parser_cls: Any) -> int:
    from . import dist
    from .runtime import resolve_device

    a = build_parser(parser_cls).parse_args(argv)
    if a.plot and not a.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {a.plot}: expected a .png file name")
    device = resolve_device(a.device, bind=False)  # --device cuda without a GPU: exit 2 here
    settings = settings_from(a, device.type)
    nproc = local_processes(a.nproc, device.type)
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if path:
            _check_writable(flag, path)
    result = run(settings, nproc)
    if dist.detect_env().rank != 0:  # under torchrun / srun: rank 0 reports
        return 0 if result["per_device_batch"] else 1
    if result["per_device_batch"] is None:
        print(f"ddpkit find-batch-size: {nothing_fits(result)}", file=sys.stderr, flush=True)
    else:
        for line in conclusion(result):
            print(line, flush=True)
    if a.plot:
        plot(result, a.plot)
        result["plot"] = a.plot
    if a.json:
        write_json(result, a.json)
    return 0 if result["per_device_batch"] else 1
