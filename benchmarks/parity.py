"""`python -m benchmarks parity`: does ddpkit's runtime cost anything over a hand-written DDP loop?

The same model, data, global batch and seed are trained for the same number of steps by

  (a) the loop the PyTorch DDP tutorial writes by hand: `DistributedDataParallel(model)`, a
      `DistributedSampler`, a `DataLoader`, `torch.optim.SGD`, and plain
      `loss.backward(); opt.step(); opt.zero_grad()`;
  (b) ddpkit's runtime: `rt.setup`, `rt.loader`, `rt.backward`, `rt.step`,

in the same worker processes, alternating: every round trains a fresh copy of the same initial
model with (a) and with (b), the order swapped each round so that neither side always runs on
a warmer machine. Each step is timed from one step's end to the next (data loading included;
CUDA events on a GPU, so no per-step synchronization disturbs the loop), the first few steps of
every phase are left out, and the ratio of the medians is reported.

Both sides see exactly the same samples on every rank at every step, so any difference in the
final weights can only come from the runtime itself: `DistributedSampler` interleaves ranks over
one shuffled order (rank r takes positions r, r+W, r+2W, ...), while ddpkit's global-batch
sampler gives rank r a contiguous slice of each global batch. So the ddpkit side is given the
same dataset laid out in the hand-written loop's per-step order -- global batch k is rank 0's
k-th micro-batch, then rank 1's, ... -- and reads it without shuffling. The dataset size is a
multiple of the global batch, so neither side pads or drops anything. The final weights of both
sides of a round are then compared bitwise (`torch.equal`) on every rank.

ddpkit reads the data its own default way (an in-memory TensorDataset stays resident on the
device: one index gather per batch, no per-sample collate); `--loader dataloader` makes it read
through a DataLoader like the hand-written loop, which isolates the runtime's own bookkeeping
(setup, loader plan, backward weighting, step) from the choice of data path.

Memory: the peak of a process that ran both loops cannot be split between them (and whatever
one phase leaves behind would count against the next), so each loop also runs alone, in a launch
of its own, after identical set-up (the same model and both dataset layouts built in both).
Each rank reports its peak -- on CUDA `torch.cuda.max_memory_allocated` (statistics reset just
before the loop), on CPU the peak RSS (VmHWM, reset just before the loop where Linux allows it)
-- and how much it grew during training. Two identical CPU launches differ in peak RSS by a MiB
or two (up to ~3 MiB seen), so the full CPU run takes the median of three launches per loop and
judges "not more memory" within CPU_MEMORY_TOLERANCE_MIB.
"""

from __future__ import annotations

import copy
import gc
import os
from dataclasses import asdict, dataclass
from typing import Any

from ddpkit.metrics import StepTimer

TARGET_STEP_TIME_RATIO = 1.01  # ddpkit / hand-written, median step time
TARGET_PEAK_MEMORY_RATIO = 1.0  # ddpkit / hand-written, peak memory of the worst rank
# Peak RSS of two identical CPU launches differs by a MiB or two (pages touched by gloo's and the
# allocator's threads vary), so on CPU "not more" means within this much of the median of three
# launches. CUDA's allocator counts bytes exactly.
CPU_MEMORY_TOLERANCE_MIB = 2.0

DESCRIPTION = "ddpkit's runtime vs a hand-written DDP loop: step-time ratio, peak memory, bitwise-equal weights"

SIDES = ("hand_written", "ddpkit")
LOADERS = ("auto", "resident", "dataloader")


@dataclass(frozen=True)
class Work:
    """What both loops train: the same for both sides, every round."""

    model: str = "cnn"
    image_size: int = 16
    classes: int = 10
    global_batch: int = 32
    steps: int = 40  # optimizer steps per phase (one epoch of the dataset)
    warmup_steps: int = 5  # left out of the timings
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    loader: str = "auto"  # ddpkit's data path: auto (its default), resident or dataloader

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    @property
    def samples(self) -> int:
        return self.steps * self.global_batch


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="cnn", help="built-in model (default cnn: two convolutions and an MLP head)")
    parser.add_argument("--image-size", type=int, default=16, help="synthetic images are 3 x SIZE x SIZE (default 16)")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="GLOBAL batch, a multiple of the processes (default 32)"
    )
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per phase (default 40; --quick 12)")
    parser.add_argument("--nproc", type=int, default=0, help="processes (default: 2 on CPU, one per GPU on CUDA)")
    parser.add_argument(
        "--loader",
        choices=LOADERS,
        default="auto",
        help="ddpkit's data path: auto (its default: the dataset resident on the device), resident, or "
        "dataloader (the same DataLoader path as the hand-written loop, to isolate the runtime)",
    )


def run(opts: Any, device: str) -> dict[str, Any]:
    import torch

    from ddpkit.errors import UsageError
    from ddpkit.launcher import launch
    from ddpkit.models import check

    extra = opts.extra
    steps = extra.get("steps") or (12 if opts.quick else 40)
    work = Work(
        model=extra.get("model", "cnn"),
        image_size=extra.get("image_size", 16),
        global_batch=extra.get("batch_size", 32),
        steps=steps,
        warmup_steps=min(5, steps // 3),
        loader=extra.get("loader", "auto"),
    )
    nproc = extra.get("nproc") or (torch.cuda.device_count() if device == "cuda" else 2)
    check(work.model, work.shape)
    if steps < 3:
        raise UsageError(f"--steps must be at least 3 (the first steps of a phase are warm-up), got {steps}")
    if nproc < 1 or (device == "cuda" and nproc > torch.cuda.device_count()):
        raise UsageError(f"--nproc must be between 1 and the number of processes this device can hold, got {nproc}")
    if work.global_batch < 1 or work.global_batch % nproc:
        raise UsageError(
            f"--batch-size {work.global_batch} must be a multiple of the {nproc} processes: the "
            "hand-written loop's DistributedSampler splits it evenly"
        )
    rounds = opts.reps(10, 2)
    ranks = launch(_timing_worker, work, rounds, device, nproc=nproc, device=device)[0]
    # Memory: each loop alone in launches of its own. Peak RSS of identical CPU runs varies by a
    # MiB or two, so on CPU the full run takes the median of three launches per loop.
    alone: dict[str, list[Any]] = {side: [] for side in SIDES}
    for i in range(1 if opts.quick or device == "cuda" else 3):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            alone[side].append(launch(_memory_worker, work, side, device, nproc=nproc, device=device)[0])
    result = _result(work, nproc, rounds, ranks, _memory(alone, device), device)
    return result


# -- inside the workers ---------------------------------------------------------------------------


def _datasets(work: Work, world: int) -> tuple[Any, Any]:
    """(the hand-written loop's dataset, the same samples in the order ddpkit reads them)."""
    import torch
    from torch.utils.data import DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(work.seed)
    templates = torch.randn((work.classes, *work.shape), generator=g)
    y = torch.randint(0, work.classes, (work.samples,), generator=g)
    x = templates[y] + torch.randn((work.samples, *work.shape), generator=g)
    hand = TensorDataset(x, y)
    # What the hand-written loop's rank r reads at step k: positions [k*b, (k+1)*b) of its
    # DistributedSampler's order. ddpkit's rank r reads positions [k*B + r*b, k*B + (r+1)*b).
    per_rank = [
        list(DistributedSampler(hand, num_replicas=world, rank=r, shuffle=True, seed=work.seed)) for r in range(world)
    ]
    b = work.global_batch // world
    order = [i for k in range(work.steps) for r in range(world) for i in per_rank[r][k * b : (k + 1) * b]]
    index = torch.tensor(order)
    return hand, TensorDataset(x[index], y[index])


def _initial_model(work: Work) -> Any:
    import torch

    from ddpkit.models import build

    torch.manual_seed(work.seed)
    return build(work.model, work.shape, work.classes)


def _hand_written(work: Work, model: Any, dataset: Any, device: Any) -> tuple[list[float], Any]:
    """The tutorial's loop, written the way the tutorial writes it."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    world, rank = (tdist.get_world_size(), tdist.get_rank()) if tdist.is_initialized() else (1, 0)
    cuda = device.type == "cuda"
    model = model.to(device)
    # One process: no process group, no DDP (what ddpkit runs there too).
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None) if world > 1 else model
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=work.seed)
    loader = DataLoader(dataset, batch_size=work.global_batch // world, sampler=sampler, pin_memory=cuda)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=work.lr, momentum=work.momentum)
    sampler.set_epoch(0)
    clock = StepTimer(device)
    clock.start()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.mark()
    return clock.seconds(), _cpu_state(model)


def _with_ddpkit(work: Work, rt: Any, model: Any, dataset: Any) -> tuple[list[float], Any, str]:
    """The same training through ddpkit's runtime; also says how its loader read the data:
    'resident' (the dataset held on the device) or 'DataLoader'."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=work.momentum)
    model, optimizer = rt.setup(model, optimizer)
    resident = {"auto": None, "resident": True, "dataloader": False}[work.loader]
    loader = rt.loader(dataset, batch_size=work.global_batch, shuffle=False, resident=resident)
    clock = StepTimer(rt.device)
    clock.start()
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
        clock.mark()
    path = "resident" if getattr(loader, "resident", None) is not None else "DataLoader"
    return clock.seconds(), _cpu_state(rt.unwrap(model)), path


def _cpu_state(model: Any) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _phase(side: str, work: Work, rt: Any, initial: Any, datasets: tuple[Any, Any]) -> dict[str, Any]:
    """Train a fresh copy of `initial` with one side: step times and final weights."""
    gc.collect()  # the previous phase's garbage is collected here, not inside this phase's timed steps
    model = copy.deepcopy(initial)
    out: dict[str, Any] = {}
    if side == "hand_written":
        out["times"], out["state"] = _hand_written(work, model, datasets[0], rt.device)
    else:
        out["times"], out["state"], out["data_path"] = _with_ddpkit(work, rt, model, datasets[1])
    return out


def _deterministic(device: str) -> None:
    """On CUDA, deterministic kernels for both sides: cuDNN may otherwise pick convolution
    algorithms that accumulate in a different order on every call, and then not even two runs of
    the same loop would agree bit for bit. (CPU kernels are deterministic at a fixed thread count.)
    The Runtime is made with cudnn_benchmark=False for the same reason: the flag is global to the
    process, so both loops run with the tutorial's default."""
    if device != "cuda":
        return
    import warnings

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # warn_only: adaptive average pooling's backward is flagged (it adds with atomics), yet it is
    # deterministic when its windows do not overlap (input size a multiple of the output's, as
    # with the default sizes): every input gradient then receives exactly one addition.
    torch.use_deterministic_algorithms(True, warn_only=True)
    # ...which would also fill every new uninitialized tensor with NaN, time neither loop pays normally.
    torch.utils.deterministic.fill_uninitialized_memory = False
    warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")


def _timing_worker(work: Work, rounds: int, device: str) -> dict[str, Any]:
    import torch

    from ddpkit.runtime import Runtime

    _deterministic(device)
    with Runtime(strategy="ddp", device=device, cudnn_benchmark=False) as rt:
        datasets = _datasets(work, rt.world_size)
        initial = _initial_model(work)
        start = _cpu_state(initial)
        local: dict[str, Any] = {
            "times": {s: [] for s in SIDES},
            "equal": [],
            "changed": [],
            "threads": torch.get_num_threads(),
            "ddpkit_data_path": None,
        }
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            phases = {side: _phase(side, work, rt, initial, datasets) for side in order}
            a, b = phases["hand_written"]["state"], phases["ddpkit"]["state"]
            local["equal"].append(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
            local["changed"].append(any(not torch.equal(a[k], start[k]) for k in a))
            for side in SIDES:
                local["times"][side].append(phases[side]["times"][work.warmup_steps :])
            local["ddpkit_data_path"] = phases["ddpkit"]["data_path"]
        return rt.gather_objects(local)


def _memory_worker(work: Work, side: str, device: str) -> list[dict[str, Any]]:
    """One loop alone in its processes, after the same set-up as the other side's launch."""
    import torch

    from ddpkit.metrics import peak_rss_mib, proc_status_mib, reset_peak_rss
    from ddpkit.runtime import Runtime

    _deterministic(device)
    with Runtime(strategy="ddp", device=device, cudnn_benchmark=False) as rt:
        datasets = _datasets(work, rt.world_size)  # both layouts on both sides: identical set-up
        initial = _initial_model(work)
        cuda = rt.device.type == "cuda"
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated() / 2**20 if cuda else 0.0
        reset = reset_peak_rss()
        before = proc_status_mib("VmRSS") or 0.0
        anon_before = proc_status_mib("RssAnon") or 0.0
        _phase(side, work, rt, initial, datasets)
        local = {
            "peak_rss_mib": peak_rss_mib(),
            "rss_before_mib": before,
            "peak_reset_before_loop": reset,
            "anon_before_mib": anon_before,
            "anon_after_mib": (proc_status_mib("RssAnon") or 0.0),
        }
        local["rss_growth_mib"] = local["peak_rss_mib"] - before
        if cuda:
            torch.cuda.synchronize()
            local["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
            local["cuda_growth_mib"] = local["cuda_peak_mib"] - cuda_before
        return rt.gather_objects(local)


# -- assembling the result --------------------------------------------------------------------


def _job_step_times(ranks: list[dict[str, Any]], side: str) -> tuple[list[float], list[list[float]]]:
    """A step's time for the job is its slowest rank's; (all steps, steps per round)."""
    rounds = [
        [max(step) for step in zip(*(rank["times"][side][r] for rank in ranks))]
        for r in range(len(ranks[0]["times"][side]))
    ]
    return [t for steps in rounds for t in steps], rounds


def _memory(alone: dict[str, list[list[dict[str, Any]]]], device: str) -> dict[str, Any]:
    """Per-rank peaks of the two loops, each measured alone (see the module docstring):
    `alone[side]` holds one list of per-rank records per launch; each value is the median over
    the launches."""
    import statistics

    reset = all(r["peak_reset_before_loop"] for side in SIDES for run in alone[side] for r in run)
    rss = "peak RSS (VmHWM) per rank, " + (
        "reset to the current RSS just before the loop, so it is the training's peak"
        if reset
        else "since process start (it could not be reset)"
    )
    per = {
        side: {
            key: [statistics.median(run[rank][key] for run in alone[side]) for rank in range(len(alone[side][0]))]
            for key in alone[side][0][0]
            if key != "peak_reset_before_loop"
        }
        for side in SIDES
    }
    out: dict[str, Any] = {
        "launches_per_loop": len(alone[SIDES[0]]),
        "rss_before_mib": {s: per[s]["rss_before_mib"] for s in SIDES},
        "peak_reset_before_loop": reset,
    }
    if device == "cuda":
        out["measure"] = (
            "each loop alone in a launch of its own after identical set-up; peak_mib: "
            "torch.cuda.max_memory_allocated per rank (statistics reset just before the loop); growth_mib: "
            "that peak minus what was allocated before the loop; host_peak_rss_mib: " + rss + ". MiB"
        )
        out["peak_mib"] = {s: per[s]["cuda_peak_mib"] for s in SIDES}
        out["growth_mib"] = {s: per[s]["cuda_growth_mib"] for s in SIDES}
        out["host_peak_rss_mib"] = {s: per[s]["peak_rss_mib"] for s in SIDES}
    else:
        out["measure"] = (
            "each loop alone in launches of its own after identical set-up, the median over "
            f"{len(alone[SIDES[0]])} launch(es) per loop, alternating; peak_mib: "
            + rss
            + "; growth_mib: that peak minus the RSS just before the loop. MiB"
        )
        out["peak_mib_per_launch"] = {s: [[r["peak_rss_mib"] for r in run] for run in alone[s]] for s in SIDES}
        out["peak_mib"] = {s: per[s]["peak_rss_mib"] for s in SIDES}
        out["growth_mib"] = {s: per[s]["rss_growth_mib"] for s in SIDES}
    return out


def _result(
    work: Work, nproc: int, rounds: int, ranks: list[dict[str, Any]], memory: dict[str, Any], device: str
) -> dict[str, Any]:
    import statistics

    from ddpkit.bench.common import stats

    steps, per_round = {}, {}
    for side in SIDES:
        steps[side], per_round[side] = _job_step_times(ranks, side)
    time_ratio = statistics.median(steps["ddpkit"]) / statistics.median(steps["hand_written"])
    round_ratios = [
        statistics.median(k) / statistics.median(h) for k, h in zip(per_round["ddpkit"], per_round["hand_written"])
    ]
    memory_ratio = max(k / h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"]))
    memory_excess = max(k - h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"]))
    tolerance = CPU_MEMORY_TOLERANCE_MIB if device == "cpu" else 0.0
    weights_equal = all(all(rank["equal"]) for rank in ranks)
    data_mib = work.samples * (3 * work.image_size**2 * 4 + 8) / 2**20
    if device == "cuda" and ranks[0]["ddpkit_data_path"] == "resident":
        # ddpkit keeps an in-memory dataset whole on the GPU (no per-step host copies); the
        # hand-written loop keeps it in host memory. Say how much of the gap that is.
        memory["resident_dataset_mib"] = data_mib
        memory["peak_memory_ratio_without_resident_dataset"] = max(
            (k - data_mib) / h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"])
        )
    return {
        "method": (
            f"{nproc} processes ({device}); every round trains a fresh copy of the same initial model for "
            f"{work.steps} steps with a hand-written DDP loop (DistributedDataParallel, DistributedSampler, "
            "DataLoader, SGD, loss.backward/opt.step/opt.zero_grad) and with ddpkit's runtime (rt.setup, rt.loader, "
            "rt.backward, rt.step), in alternating order. A step is timed from the end of one to the end of the next "
            f"(data loading included; CUDA events on GPU), the first {work.warmup_steps} steps of each phase left out; "
            "a step's time is its slowest rank's. Both sides read exactly the same samples per rank per step: the "
            "ddpkit side's dataset is the hand-written DistributedSampler's per-rank order laid out so ddpkit's "
            "global-batch sampler (shuffle=False, rank r takes a contiguous slice of each global batch) hands every "
            "rank the same micro-batch; the dataset is a whole number of global batches (no padding, no drop). So "
            "any difference in the final weights (compared bitwise with torch.equal on every rank) comes from the "
            "runtime itself."
            + (
                " On CUDA both sides run deterministic cuDNN/cuBLAS kernels (cudnn.benchmark off)."
                if device == "cuda"
                else ""
            )
        ),
        "work": {**asdict(work), "samples": work.samples, "dataset_mib": data_mib},
        "nproc": nproc,
        "rounds": rounds,
        "threads_per_process": ranks[0]["threads"],
        "ddpkit_data_path": ranks[0]["ddpkit_data_path"],
        "step_time_ratio": time_ratio,
        "step_time_ratio_per_round": round_ratios,
        "step_seconds": {side: stats(steps[side]) for side in SIDES},
        "step_seconds_all": steps,
        "peak_memory_ratio": memory_ratio,
        "peak_memory_excess_mib": memory_excess,
        "memory": memory,
        "weights_equal": weights_equal,
        "weights_equal_per_round": [all(rank["equal"][r] for rank in ranks) for r in range(rounds)],
        "weights_changed_by_training": all(all(rank["changed"]) for rank in ranks),
        "target": {
            "step_time_ratio": TARGET_STEP_TIME_RATIO,
            "peak_memory_ratio": TARGET_PEAK_MEMORY_RATIO,
            "peak_memory_tolerance_mib": tolerance,
            "weights_equal": True,
        },
        "meets_target": {
            "step_time_ratio": time_ratio <= TARGET_STEP_TIME_RATIO,
            "peak_memory_ratio": memory_ratio <= TARGET_PEAK_MEMORY_RATIO or memory_excess <= tolerance,
            "weights_equal": weights_equal,
        },
    }


# -- report ----------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    labels = ["hand-written", "ddpkit"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    data = [[t * 1e3 for t in r["step_seconds_all"][side]] for side in SIDES]
    left.boxplot(data, showfliers=True)
    left.set_xticks([1, 2], labels)
    left.set_ylabel("step time (ms)")
    left.set_title(f"step time: ddpkit / hand-written = {r['step_time_ratio']:.3f} (median)")
    peaks, growth = r["memory"]["peak_mib"], r["memory"]["growth_mib"]
    n = len(peaks["hand_written"])
    width = 0.38
    for i, (side, label) in enumerate(zip(SIDES, labels)):
        xs = [k + (i - 0.5) * width for k in range(n)]
        below = [p - g for p, g in zip(peaks[side], growth[side])]
        right.bar(xs, below, width, color=f"C{i}", alpha=0.35)
        right.bar(xs, growth[side], width, bottom=below, color=f"C{i}", label=f"{label} (dark: growth in training)")
        for x, p in zip(xs, peaks[side]):
            right.annotate(f"{p:.1f}", (x, p), ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(n), [f"rank {k}" for k in range(n)])
    right.set_ylabel("peak allocated (MiB)" if record.get("device") == "cuda" else "peak RSS (MiB)")
    right.set_title(f"peak memory ratio {r['peak_memory_ratio']:.3f}; weights equal: {r['weights_equal']}")
    right.legend(loc="lower right")
    fig.suptitle(
        f"parity on {r['nproc']} {record.get('device', '')} processes, {r['work']['model']}, "
        f"global batch {r['work']['global_batch']}",
        fontsize=10,
    )
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    ok = result["meets_target"]
    hand, kit = result["step_seconds"]["hand_written"]["median"], result["step_seconds"]["ddpkit"]["median"]
    return [
        (
            "step time ddpkit / hand-written (median)",
            f"{result['step_time_ratio']:.3f} (target <= {TARGET_STEP_TIME_RATIO}: {'met' if ok['step_time_ratio'] else 'missed'})",
        ),
        ("step time hand-written / ddpkit", f"{hand * 1e3:.2f} ms / {kit * 1e3:.2f} ms"),
        (
            "peak memory ddpkit / hand-written (worst rank)",
            (
                f"{result['peak_memory_ratio']:.3f}, {result['peak_memory_excess_mib']:+.1f} MiB (target <= "
                f"{TARGET_PEAK_MEMORY_RATIO}, within {result['target']['peak_memory_tolerance_mib']:g} MiB: "
                f"{'met' if ok['peak_memory_ratio'] else 'missed'})"
            ),
        ),
        ("final weights bitwise equal", "yes" if result["weights_equal"] else "NO"),
    ]
