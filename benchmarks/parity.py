"""`python -m benchmarks parity`: does ddpkit's runtime cost anything over a hand-written loop,
measured finely enough to tell "nothing" from "1%"?

The same model, data, global batch and seed are trained for the same number of steps by

  (a) the loop one writes by hand from PyTorch's tutorials: a `DataLoader`, `torch.optim.SGD`,
      plain `loss.backward(); opt.step(); opt.zero_grad()`, and per strategy the model bare
      (`single`, shuffled by the DataLoader), in `DistributedDataParallel(model)` (`ddp`) or
      under FSDP2's `fully_shard` on each child holding parameters and on the root (`fsdp`),
      those two with a `DistributedSampler`;
  (b) ddpkit's runtime: `Runtime(strategy=...)`, `rt.setup`, `rt.loader`, `rt.backward`,
      `rt.step`,

in the same worker processes, interleaved step by step: every round trains a fresh copy of the
same initial model for one epoch with (a) and with (b), one step of each in turn (which goes
first swaps every round), so whatever else the machine does -- another job taking a core for a
moment -- falls on both within a step's time, not on one loop's whole epoch. Each step is timed
on its own (data loading included; CUDA events on a GPU, read after the epoch, so no per-step
synchronization disturbs the loop), and the process's CPU time (`time.process_time`: every
thread of the process, gloo's and the intra-op pool's included) is read around it; the first
few steps of every epoch are left out.

Two measurements, each in one launch:

- ONE process: `single`, `ddp` and `fsdp` in turn. Its process group (gloo, or NCCL on CUDA,
  world of 1) is made by the worker, as a hand-written DDP or FSDP2 script makes its own: ddpkit
  makes none for one process, and the hand-written DDP and fully_shard loops need one. ddpkit's
  Runtime runs `ddp` and `fsdp` on one process as `single` (the bare model: wrapping it would
  all-reduce or shard over one rank for nothing), so for those two the comparison is "what you
  get from ddpkit when you ask for ddp/fsdp on one process" against the wrapped hand-written loop;
  `runs_as` in the JSON says so. One intra-op thread by default (`--threads`): two threads on
  one process wait for each other at every operation whenever another job holds a core.
- `--nproc` processes (default 2 on CPU): `ddp` and `fsdp`. ddpkit's fsdp on CPU sets glibc's
  mmap threshold for the whole process (ddpkit.core.allocator); it runs after ddp, and the
  hand-written FSDP2 loop beside it runs under the same setting.

Per round and side, the step time is the median over the timed steps of the job's step (its
slowest rank's), and the CPU time per step is the timed steps' CPU seconds over their number,
summed over the ranks. The result for each strategy is the median over rounds of the paired
ratio ddpkit / hand-written, with a 95% percentile-bootstrap interval of that median (the rounds
resampled; benchmarks/paired.py). Wall time measures what a user waits for, but it also counts
the time another process held the core; CPU time counts only the work done (gloo's waits for
the peer block in the kernel, they do not spin), so on a shared machine it is the steadier of
the two.

Verdict (per measurement, in the JSON and the summary), for the target ratio <= 1.01: 'not
resolved' when the interval is wider than 0.01 (its width, not its half-width: a 95% interval
of width 0.02 around 1.005 holds both 1.00 and 1.01, which is the difference the measurement is
there to tell), or when it straddles 1.01, or with fewer than MIN_ROUNDS rounds; otherwise
'met' (upper bound <= 1.01) or 'not met' (lower bound > 1.01).

Both sides see exactly the same samples on every rank at every step, so any difference in the
final weights can only come from the runtime itself: `DistributedSampler` interleaves ranks over
one shuffled order (rank r takes positions r, r+W, r+2W, ...), while ddpkit's global-batch
sampler gives rank r a contiguous slice of each global batch. So the ddpkit side is given the
same dataset laid out in the hand-written loop's per-step order -- global batch k is rank 0's
k-th micro-batch, then rank 1's, ... -- and reads it without shuffling. The dataset size is a
multiple of the global batch, so neither side pads or drops anything. The final weights of both
sides of a round are then compared bitwise (`torch.equal`, sharded weights gathered whole) on
every rank.

ddpkit reads the data its own default way (an in-memory TensorDataset stays resident on the
device: one index gather per batch, no per-sample collate); `--loader dataloader` makes it read
through a DataLoader like the hand-written loop, which isolates the runtime's own bookkeeping
(setup, loader plan, backward weighting, step) from the choice of data path.

Memory (ddp on `--nproc` processes, or single on one): the peak of a process that ran both loops
cannot be split between them (and whatever one phase leaves behind would count against the
next), so each loop also runs alone, in a launch of its own, after identical set-up (the same
model and both dataset layouts built in both). Each rank reports its peak -- on CUDA
`torch.cuda.max_memory_allocated` (statistics reset just before the loop), on CPU the peak RSS
(VmHWM, reset just before the loop where Linux allows it) -- and how much it grew during
training. Two identical CPU launches differ in peak RSS by a MiB or two (up to ~3 MiB seen), so
the full CPU run takes the median of three launches per loop and judges "not more memory"
within CPU_MEMORY_TOLERANCE_MIB.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from .paired import MIN_ROUNDS, NOT_RESOLVED, paired_ratio

TARGET_STEP_TIME_RATIO = 1.01  # ddpkit / hand-written, median over rounds of the paired ratio
TARGET_PEAK_MEMORY_RATIO = 1.0  # ddpkit / hand-written, peak memory of the worst rank
# Peak RSS of two identical CPU launches differs by a MiB or two (pages touched by gloo's and the
# allocator's threads vary), so on CPU "not more" means within this much of the median of three
# launches. CUDA's allocator counts bytes exactly.
CPU_MEMORY_TOLERANCE_MIB = 2.0

DESCRIPTION = (
    "ddpkit's runtime vs hand-written single/DDP/FSDP2 loops on 1 and N processes, alternating: paired "
    "step-time ratios with 95% intervals, peak memory, bitwise-equal weights"
)

SIDES = ("hand_written", "ddpkit")
LOADERS = ("auto", "resident", "dataloader")
ONE_PROCESS = ("single", "ddp", "fsdp")
PROCESSES = ("ddp", "fsdp")
STATISTICS = {"wall": "wall time per step", "cpu": "CPU time per step"}
HAND_WRITTEN = {
    "single": "the bare model, DataLoader(shuffle=True), SGD",
    "ddp": "DistributedDataParallel, DistributedSampler, DataLoader, SGD",
    "fsdp": "fully_shard on each child holding parameters and on the root, DistributedSampler, DataLoader, SGD",
}
# Rounds by default: enough for a one-process interval narrower than 0.01 on the 2-core machine
# this was written on, while the whole run stays within a few minutes (docs/speed.md).
ROUNDS_ONE, ROUNDS_N, QUICK_ROUNDS = 40, 30, 2


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
    parser.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="processes of the second measurement (default: 2 on CPU, one per GPU on CUDA; 1 runs only the first)",
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help=f"alternating rounds on one process (default {ROUNDS_ONE}; --quick 2)"
    )
    parser.add_argument(
        "--nproc-rounds",
        type=int,
        default=0,
        help=f"alternating rounds on --nproc processes (default {ROUNDS_N}; --quick 2)",
    )
    parser.add_argument(
        "--loader",
        choices=LOADERS,
        default="auto",
        help="ddpkit's data path: auto (its default: the dataset resident on the device), resident, or "
        "dataloader (the same DataLoader path as the hand-written loop, to isolate the runtime)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of the one-process measurement (default 1 on CPU, as each of 2 processes has on 2 "
        "cores; on CUDA the Runtime's own)",
    )
    parser.add_argument("--note", default="", help="where it ran, in words (kept in the JSON): a shared machine, say")


def run(opts: Any, device: str) -> dict[str, Any]:
    from ddpkit.launcher import launch

    work, nproc, rounds = _options(opts, device)
    threads = opts.extra.get("threads") or (1 if device == "cpu" else 0)
    one = launch(_timing_worker, work, ONE_PROCESS, rounds[0], device, threads, nproc=1, device=device)[0]
    many = None
    if nproc > 1:
        many = launch(_timing_worker, work, PROCESSES, rounds[1], device, 0, nproc=nproc, device=device)[0]
    # Memory: each loop alone in launches of its own. Peak RSS of identical CPU runs varies by a
    # MiB or two, so on CPU the full run takes the median of three launches per loop.
    alone: dict[str, list[Any]] = {side: [] for side in SIDES}
    for i in range(1 if opts.quick or device == "cuda" else 3):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            alone[side].append(launch(_memory_worker, work, side, device, nproc=nproc, device=device)[0])
    return {
        **_result(work, nproc, rounds, one, many, _memory(alone, device), device),
        "note": opts.extra.get("note", ""),
    }


def _options(opts: Any, device: str) -> tuple[Work, int, tuple[int, int]]:
    """The work, the processes and the rounds (one process, N processes) the options ask for."""
    import torch

    from ddpkit.errors import UsageError
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
    rounds = (
        extra.get("rounds") or opts.reps(ROUNDS_ONE, QUICK_ROUNDS),
        extra.get("nproc_rounds") or opts.reps(ROUNDS_N, QUICK_ROUNDS),
    )
    check(work.model, work.shape)
    if steps < 3:
        raise UsageError(f"--steps must be at least 3 (the first steps of a phase are warm-up), got {steps}")
    if min(rounds) < 1:
        raise UsageError(f"--rounds and --nproc-rounds must be at least 1, got {rounds[0]} and {rounds[1]}")
    if nproc < 1 or (device == "cuda" and nproc > torch.cuda.device_count()):
        raise UsageError(f"--nproc must be between 1 and the number of processes this device can hold, got {nproc}")
    if work.global_batch < 1 or work.global_batch % nproc:
        raise UsageError(
            f"--batch-size {work.global_batch} must be a multiple of the {nproc} processes: the "
            "hand-written loop's DistributedSampler splits it evenly"
        )
    return work, nproc, rounds


# -- inside the workers ---------------------------------------------------------------------------


def _hand_order(dataset: Any, work: Work, world: int, rank: int, strategy: str) -> list[int]:
    """The sample indices the hand-written `strategy` loop's rank reads, in order."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    if strategy == "single":
        # The same DataLoader over the indices: its iterator draws a seed from the generator
        # before the sampler draws its permutation, so the sampler alone would not say.
        g = torch.Generator().manual_seed(work.seed)
        batches = DataLoader(range(len(dataset)), batch_size=work.global_batch, shuffle=True, generator=g)
        return [int(i) for batch in batches for i in batch]
    return list(DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=work.seed))


def _datasets(work: Work, world: int, strategy: str = "ddp") -> tuple[Any, Any]:
    """(the hand-written loop's dataset, the same samples in the order ddpkit reads them)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(work.seed)
    templates = torch.randn((work.classes, *work.shape), generator=g)
    y = torch.randint(0, work.classes, (work.samples,), generator=g)
    x = templates[y] + torch.randn((work.samples, *work.shape), generator=g)
    hand = TensorDataset(x, y)
    # What the hand-written loop's rank r reads at step k: positions [k*b, (k+1)*b) of its
    # sampler's order. ddpkit's rank r reads positions [k*B + r*b, k*B + (r+1)*b).
    per_rank = [_hand_order(hand, work, world, r, strategy) for r in range(world)]
    b = work.global_batch // world
    order = [i for k in range(work.steps) for r in range(world) for i in per_rank[r][k * b : (k + 1) * b]]
    index = torch.tensor(order)
    return hand, TensorDataset(x[index], y[index])


def _initial_model(work: Work) -> Any:
    import torch

    from ddpkit.models import build

    torch.manual_seed(work.seed)
    return build(work.model, work.shape, work.classes)


class _Steps:
    """Times one loop's steps one at a time: wall seconds (CUDA events on a GPU, read at the end:
    no synchronization per step) and this process's CPU seconds, all its threads (gloo's and
    the intra-op pool's) included."""

    def __init__(self, device: Any):
        from ddpkit.observe.metrics import stamp

        self.cuda = device.type == "cuda"
        self._stamp = functools.partial(stamp, self.cuda)  # a CUDA event or perf_counter()
        self.wall: list[tuple[Any, Any]] = []
        self.cpu: list[float] = []
        self.last: Any = None  # what the loop yielded last

    def run(self, loop: Iterator[Any]) -> bool:
        """One step of `loop` (its data loading included); False once the loop has ended."""
        start, cpu = self._stamp(), time.process_time()
        try:
            self.last = next(loop)
        except StopIteration:
            return False
        self.cpu.append(time.process_time() - cpu)
        self.wall.append((start, self._stamp()))
        return True

    def timed(self, warmup: int) -> dict[str, Any]:
        """The steps after `warmup`: their wall seconds, and CPU seconds per step."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = [a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in self.wall[warmup:]]
        return {"wall": wall, "cpu": sum(self.cpu[warmup:]) / len(wall)}


def _hand_loader(work: Work, strategy: str, dataset: Any, cuda: bool) -> Any:
    """The DataLoader a hand-written `strategy` loop reads through."""
    import torch
    import torch.distributed as tdist
    from torch.utils.data import DataLoader, DistributedSampler

    if strategy == "single":
        g = torch.Generator().manual_seed(work.seed)
        return DataLoader(dataset, batch_size=work.global_batch, shuffle=True, generator=g, pin_memory=cuda)
    world, rank = tdist.get_world_size(), tdist.get_rank()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=work.seed)
    sampler.set_epoch(0)
    return DataLoader(dataset, batch_size=work.global_batch // world, sampler=sampler, pin_memory=cuda)


def _hand_wrap(strategy: str, model: Any, device: Any) -> Any:
    """The model as a hand-written `strategy` loop wraps it."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if strategy == "fsdp":
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(model)
    return model


def _hand_written(work: Work, strategy: str, model: Any, dataset: Any, device: Any) -> Iterator[None]:
    """The tutorial's loop, written the way the tutorial writes it; yields after each step."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    loader = _hand_loader(work, strategy, dataset, cuda)
    net = _hand_wrap(strategy, model.to(device), device)
    optimizer = torch.optim.SGD(net.parameters(), lr=work.lr, momentum=work.momentum)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def _with_ddpkit(work: Work, rt: Any, model: Any, dataset: Any) -> Iterator[str]:
    """The same training through ddpkit's runtime; yields after each step how its loader reads
    the data: 'resident' (the dataset held on the device) or 'DataLoader'."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=work.momentum)
    model, optimizer = rt.setup(model, optimizer)
    resident = {"auto": None, "resident": True, "dataloader": False}[work.loader]
    loader = rt.loader(dataset, batch_size=work.global_batch, shuffle=False, resident=resident)
    path = "resident" if getattr(loader, "resident", None) is not None else "DataLoader"
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(optimizer)
        yield path


def _loop(side: str, strategy: str, work: Work, rt: Any, model: Any, datasets: tuple[Any, Any]) -> Iterator[Any]:
    """One side's loop over one epoch, training `model` in place (setup and wrapping keep its
    parameters: the caller reads the final weights from it)."""
    if side == "hand_written":
        return _hand_written(work, strategy, model, datasets[0], rt.device)
    return _with_ddpkit(work, rt, model, datasets[1])


def _cpu_state(model: Any) -> dict[str, Any]:
    """The model's weights, copied to the CPU; sharded ones gathered whole (collective)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
        for k, v in model.state_dict().items()
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _round(order: tuple[str, ...], strategy: str, work: Work, rt: Any, initial: Any, datasets: Any) -> dict[str, Any]:
    """Both loops train a fresh copy of `initial` for an epoch, interleaved step by step in
    `order`: whatever else the machine does weighs on both within a step's time. Per side: the
    timed steps' wall seconds, CPU seconds per step, final weights."""
    gc.collect()  # the previous round's garbage is collected here, not inside a timed step
    models = {side: copy.deepcopy(initial) for side in SIDES}
    loops = {side: _loop(side, strategy, work, rt, models[side], datasets) for side in SIDES}
    steps = {side: _Steps(rt.device) for side in SIDES}
    while all([steps[side].run(loops[side]) for side in order]):  # a list: every side steps
        pass
    return {
        side: {**steps[side].timed(work.warmup_steps), "state": _cpu_state(models[side]), "yielded": steps[side].last}
        for side in SIDES
    }


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


def _timing_worker(
    work: Work, strategies: tuple[str, ...], rounds: int, device: str, threads: int
) -> list[dict[str, Any]]:
    """Each strategy in turn, its two loops interleaved for `rounds` rounds; every rank's record.
    `threads`: intra-op threads for both loops (0: as the Runtime sets them)."""
    import torch
    import torch.distributed as tdist

    from ddpkit.core import dist
    from ddpkit.runtime import Runtime

    _deterministic(device)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The process group, made as a hand-written script makes it: DistributedDataParallel and
    # fully_shard need one on one process too, where ddpkit makes none. Made here, it outlives
    # the Runtimes below (one per strategy, none of which then owns it).
    tdist.init_process_group(dist.backend_for(torch.device(device)))
    try:
        local: dict[str, Any] = {}
        for strategy in strategies:
            with Runtime(strategy=strategy, device=device, cudnn_benchmark=False) as rt:
                if threads:
                    # After the Runtime, which sets its own count. Two threads on one process
                    # wait for each other at every operation whenever another job holds a core.
                    torch.set_num_threads(threads)
                local[strategy] = _alternate(work, strategy, rounds, rt)
        return dist.gather_objects(local)
    finally:
        tdist.destroy_process_group()


def _alternate(work: Work, strategy: str, rounds: int, rt: Any) -> dict[str, Any]:
    """`rounds` rounds of both loops interleaved step by step, which one steps first swapped
    every round."""
    import torch

    datasets = _datasets(work, rt.world_size, strategy)
    initial = _initial_model(work)
    start = _cpu_state(initial)
    out: dict[str, Any] = {
        "runs_as": rt.strategy,
        "threads": torch.get_num_threads(),
        "wall": {s: [] for s in SIDES},  # per round: the timed steps' seconds
        "cpu": {s: [] for s in SIDES},  # per round: CPU seconds per step
        "equal": [],
        "changed": [],
    }
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        phases = _round(order, strategy, work, rt, initial, datasets)
        out["equal"].append(_same(phases["hand_written"]["state"], phases["ddpkit"]["state"]))
        out["changed"].append(not _same(phases["hand_written"]["state"], start))
        for side in SIDES:
            out["wall"][side].append(phases[side]["wall"])
            out["cpu"][side].append(phases[side]["cpu"])
        out["data_path"] = phases["ddpkit"]["yielded"]
    return out


def _memory_worker(work: Work, side: str, device: str) -> list[dict[str, Any]]:
    """One loop alone in its processes, after the same set-up as the other side's launch."""
    import torch

    from ddpkit.core.memory import peak_rss_mib, proc_status_mib, reset_peak_rss
    from ddpkit.runtime import Runtime

    _deterministic(device)
    with Runtime(strategy="ddp", device=device, cudnn_benchmark=False) as rt:
        strategy = "ddp" if rt.world_size > 1 else "single"
        datasets = _datasets(work, rt.world_size, strategy)  # both layouts on both sides: identical set-up
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
        gc.collect()
        for _ in _loop(side, strategy, work, rt, copy.deepcopy(initial), datasets):
            pass
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


def _per_round(per: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per statistic and side, one value per round for the job: the wall seconds of a step (the
    median over the timed steps of the slowest rank's time) and its CPU seconds (summed over
    the ranks)."""
    rounds = range(len(per[0]["equal"]))
    wall = {
        side: [statistics.median(max(step) for step in zip(*(p["wall"][side][r] for p in per))) for r in rounds]
        for side in SIDES
    }
    cpu = {side: [sum(p["cpu"][side][r] for p in per) for r in rounds] for side in SIDES}
    return {"wall": wall, "cpu": cpu}


def _comparison(ranks: list[dict[str, Any]], strategy: str) -> dict[str, Any]:
    """One strategy's two loops: µs per step of each, and the paired ratios with their verdicts."""
    from ddpkit.bench.common import stats

    per = [rank[strategy] for rank in ranks]
    values = _per_round(per)
    equal = [all(p["equal"][r] for p in per) for r in range(len(per[0]["equal"]))]
    return {
        "hand_written": HAND_WRITTEN[strategy],
        "runs_as": per[0]["runs_as"],  # the strategy ddpkit's Runtime ran ('single' for ddp/fsdp on one process)
        "threads_per_process": per[0]["threads"],
        "ddpkit_data_path": per[0]["data_path"],
        "us_per_step": {side: stats([v * 1e6 for v in values["wall"][side]]) for side in SIDES},
        "cpu_us_per_step": {side: stats([v * 1e6 for v in values["cpu"][side]]) for side in SIDES},
        **{
            stat: paired_ratio(values[stat]["hand_written"], values[stat]["ddpkit"], TARGET_STEP_TIME_RATIO)
            for stat in STATISTICS
        },
        "weights_equal": all(equal),
        "weights_equal_per_round": equal,
        "weights_changed_by_training": all(all(p["changed"]) for p in per),
    }


def _part(ranks: list[dict[str, Any]], strategies: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """One launch's comparisons, and which statistic resolved every strategy's ratio."""
    found = {s: _comparison(ranks, s) for s in strategies}
    return {
        "processes": len(ranks),
        "rounds": rounds,
        "strategies": found,
        "resolved_by": [stat for stat in STATISTICS if all(c[stat]["status"] != NOT_RESOLVED for c in found.values())],
    }


def _verdicts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measurement's interval, target and status, flat, for the summary and the plot."""
    return [
        {
            "processes": part["processes"],
            "strategy": strategy,
            "runs_as": c["runs_as"],
            "statistic": stat,
            "ratio": c[stat]["ratio"],
            "interval95": c[stat]["interval95"],
            "target": TARGET_STEP_TIME_RATIO,
            "status": c[stat]["status"],
        }
        for part in parts
        for strategy, c in part["strategies"].items()
        for stat in STATISTICS
    ]


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
    work: Work,
    nproc: int,
    rounds: tuple[int, int],
    one: list[dict[str, Any]],
    many: list[dict[str, Any]] | None,
    memory: dict[str, Any],
    device: str,
) -> dict[str, Any]:
    parts = [_part(one, ONE_PROCESS, rounds[0])] + ([_part(many, PROCESSES, rounds[1])] if many else [])
    memory_ratio = max(k / h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"]))
    memory_excess = max(k - h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"]))
    tolerance = CPU_MEMORY_TOLERANCE_MIB if device == "cpu" else 0.0
    weights_equal = all(c["weights_equal"] for part in parts for c in part["strategies"].values())
    data_mib = work.samples * (3 * work.image_size**2 * 4 + 8) / 2**20
    if device == "cuda" and parts[0]["strategies"]["single"]["ddpkit_data_path"] == "resident":
        # ddpkit keeps an in-memory dataset whole on the GPU (no per-step host copies); the
        # hand-written loop keeps it in host memory. Say how much of the gap that is.
        memory["resident_dataset_mib"] = data_mib
        memory["peak_memory_ratio_without_resident_dataset"] = max(
            (k - data_mib) / h for k, h in zip(memory["peak_mib"]["ddpkit"], memory["peak_mib"]["hand_written"])
        )
    return {
        "method": _method(work, nproc, device),
        "work": {**asdict(work), "samples": work.samples, "dataset_mib": data_mib},
        "nproc": nproc,
        "one_process": parts[0],
        "n_processes": parts[1] if many else None,
        "verdicts": _verdicts(parts),
        "peak_memory_ratio": memory_ratio,
        "peak_memory_excess_mib": memory_excess,
        "memory": memory,
        "weights_equal": weights_equal,
        "target": {
            "step_time_ratio": TARGET_STEP_TIME_RATIO,
            "resolution": TARGET_STEP_TIME_RATIO - 1.0,
            "min_rounds": MIN_ROUNDS,
            "status": (
                "'not resolved' when the 95% interval of the median paired ratio is wider than the resolution, "
                f"straddles the target, or rests on fewer than {MIN_ROUNDS} rounds; else 'met' (upper bound <= "
                "target) or 'not met' (lower bound > target)"
            ),
            "peak_memory_ratio": TARGET_PEAK_MEMORY_RATIO,
            "peak_memory_tolerance_mib": tolerance,
            "weights_equal": True,
        },
        "meets_target": {
            "peak_memory_ratio": memory_ratio <= TARGET_PEAK_MEMORY_RATIO or memory_excess <= tolerance,
            "weights_equal": weights_equal,
        },
    }


def _method(work: Work, nproc: int, device: str) -> str:
    return (
        f"Two launches ({device}): one process (single, ddp, fsdp; ddpkit's Runtime runs ddp and fsdp on one process "
        f"as single, the hand-written loops wrap the model in a process group of 1 made by the worker), then {nproc} "
        "processes (ddp, fsdp). Per strategy, every round trains a fresh copy of the same initial model for "
        f"{work.steps} steps with the hand-written loop and with ddpkit's runtime (rt.setup, rt.loader, rt.backward, "
        "rt.step), in an order swapped every round. A step is timed from the end of one to the end of the next (data "
        f"loading included; CUDA events on GPU), the first {work.warmup_steps} steps of each phase left out. Per round "
        "and side: wall = the median over the timed steps of the slowest rank's step time; cpu = the timed steps' "
        "CPU seconds (time.process_time, all threads) per step, summed over the ranks. ratio = the median over rounds "
        "of the paired ratio ddpkit / hand-written, interval95 = its 95% percentile-bootstrap interval (4000 "
        "resamples of the rounds). Both sides read exactly the same samples per rank per step (the ddpkit side's "
        "dataset is the hand-written sampler's per-rank order laid out for ddpkit's global-batch sampler, "
        "shuffle=False); the final weights are compared bitwise (torch.equal, sharded ones gathered whole) on every "
        "rank, so any difference comes from the runtime itself."
        + (
            " On CUDA both sides run deterministic cuDNN/cuBLAS kernels (cudnn.benchmark off)."
            if device == "cuda"
            else ""
        )
    )


# -- report ----------------------------------------------------------------------------------


def _label(v: dict[str, Any]) -> str:
    runs = f" (runs as {v['runs_as']})" if v["runs_as"] != v["strategy"] else ""
    return f"{v['processes']} process{'es' if v['processes'] > 1 else ''}, {v['strategy']}{runs}"


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for part in (result["one_process"], result["n_processes"]):
        if part is None:
            continue
        for strategy, c in part["strategies"].items():
            hand, kit = (c["us_per_step"][side]["median"] for side in SIDES)
            ratios = "; ".join(
                f"{stat} {c[stat]['ratio']:.3f} [{c[stat]['interval95'][0]:.3f}, {c[stat]['interval95'][1]:.3f}] "
                f"{c[stat]['status']}"
                for stat in STATISTICS
            )
            label = _label({"processes": part["processes"], "strategy": strategy, "runs_as": c["runs_as"]})
            rows.append((f"{label}: ddpkit / hand-written per step", f"{ratios} ({hand:,.0f} / {kit:,.0f} µs wall)"))
        resolved = " and ".join(part["resolved_by"]) or "neither wall nor cpu time"
        rows.append((f"{part['processes']} process(es): 1% resolved by", f"{resolved} ({part['rounds']} rounds)"))
    ok = result["meets_target"]
    rows.append(
        (
            "peak memory ddpkit / hand-written (worst rank)",
            (
                f"{result['peak_memory_ratio']:.3f}, {result['peak_memory_excess_mib']:+.1f} MiB (target <= "
                f"{TARGET_PEAK_MEMORY_RATIO}, within {result['target']['peak_memory_tolerance_mib']:g} MiB: "
                f"{'met' if ok['peak_memory_ratio'] else 'not met'})"
            ),
        )
    )
    rows.append(("final weights bitwise equal", "yes" if result["weights_equal"] else "NO"))
    return rows


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    verdicts = r["verdicts"]
    for i, v in enumerate(verdicts):
        low, high = v["interval95"]
        color = {"met": "C2", "not met": "C3"}.get(v["status"], "C7")
        left.errorbar(v["ratio"], i, xerr=[[v["ratio"] - low], [high - v["ratio"]]], fmt="o", color=color, capsize=3)
    left.set_yticks(range(len(verdicts)), [f"{_label(v)}, {v['statistic']}" for v in verdicts], fontsize=8)
    left.invert_yaxis()
    left.axvline(1.0, color="k", linewidth=0.8)
    left.axvline(TARGET_STEP_TIME_RATIO, color="C3", linestyle="--", label=f"target {TARGET_STEP_TIME_RATIO}")
    left.set_xlabel("ddpkit / hand-written per step: median paired ratio, 95% interval")
    left.set_title("green: met, red: not met, grey: not resolved", fontsize=9)
    left.legend(fontsize=8)
    _plot_memory(right, r, record.get("device"))
    fig.suptitle(f"parity, {r['work']['model']}, global batch {r['work']['global_batch']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _plot_memory(ax: Any, r: dict[str, Any], device: str | None) -> None:
    peaks, growth = r["memory"]["peak_mib"], r["memory"]["growth_mib"]
    n = len(peaks["hand_written"])
    width = 0.38
    for i, (side, label) in enumerate(zip(SIDES, ("hand-written", "ddpkit"))):
        xs = [k + (i - 0.5) * width for k in range(n)]
        below = [p - g for p, g in zip(peaks[side], growth[side])]
        ax.bar(xs, below, width, color=f"C{i}", alpha=0.35)
        ax.bar(xs, growth[side], width, bottom=below, color=f"C{i}", label=f"{label} (dark: growth in training)")
        for x, p in zip(xs, peaks[side]):
            ax.annotate(f"{p:.1f}", (x, p), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(n), [f"rank {k}" for k in range(n)])
    ax.set_ylabel("peak allocated (MiB)" if device == "cuda" else "peak RSS (MiB)")
    ax.set_title(f"peak memory ratio {r['peak_memory_ratio']:.3f}; weights equal: {r['weights_equal']}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
