"""The sharded part of `ddpkit bench strategies`: single, ddp and fsdp on a model of 100M
parameters, per-rank peak memory and step time, and fsdp against a hand-written FSDP2 loop.

The model is a wide MLP (`depth` layers of width x width, ReLU between, a small head), trained
with AdamW, whose state (two tensors per parameter) is what sharding divides most. Every device
gets the same per-device batch (as in the scaling part). Each configuration runs in a launch of
its own, so its peak is its own:

- `single` on one process (ddp and fsdp on one process run as single: the same configuration,
  reported under their names with `runs_as`);
- `ddp` and `fsdp` through ddpkit's Runtime on two processes (fsdp: `rt.build` and `rt.setup`,
  so ranks other than 0 build on the meta device);
- `fsdp2_hand_written`: the loop one writes with FSDP2 alone: every rank builds the model,
  `fully_shard` on each layer and the root, `loss.backward(); opt.step(); opt.zero_grad()`,
  with glibc's mmap threshold as ddpkit's fsdp holds it (see `ddpkit.core.allocator`), and again
  with glibc's default allocator (`..._glibc_default`), which shows what that setting trades.

Peak memory: on CPU the peak RSS (VmHWM) of each rank, counted from the worker's start (reset
there), so it includes what the process holds before training: torch itself, the data, and
the model's build (rank 0's full copy under fsdp); the peak while training alone is reported
too. On CUDA `torch.cuda.max_memory_allocated`. Step time: each step timed from the previous
one's end after warm-up steps; a job's step takes its slowest rank's time.

fsdp against the hand-written loop: both run in the same two processes, built once, in
alternating blocks of steps (the order swapped each round), so machine load hits both alike;
the ratio is of the medians of their step times, with the same allocator setting.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

TARGET_STEP_TIME_RATIO = 1.01  # ddpkit's fsdp / the hand-written FSDP2 loop
TARGET_MEMORY_RATIO = 0.6  # fsdp / ddp peak memory at N = 2
HAND = "fsdp2_hand_written"
HAND_DEFAULT = "fsdp2_hand_written_glibc_default"
CONFIGS = ("single", "ddp", "fsdp", HAND, HAND_DEFAULT)
SHORT = {HAND: "FSDP2 by hand", HAND_DEFAULT: "FSDP2 by hand,\nglibc default"}  # plot labels
METHOD = (
    "a wide MLP (depth x Linear(width, width), ReLU, a small head) trained with AdamW, the same batch per "
    "device; each configuration in a launch of its own: single (ddp and fsdp on one process run as single), "
    "ddp and fsdp through ddpkit's Runtime (fsdp: rt.build, so ranks other than 0 build on meta), and a "
    "hand-written FSDP2 loop (fully_shard on each layer and the root, loss.backward/opt.step/opt.zero_grad) "
    "with glibc's mmap threshold held at 1 MiB as ddpkit's fsdp does, and with glibc's default allocator. "
    "peak_mib: each rank's peak from the worker's start (build and setup included; on CPU VmHWM, reset at "
    "the start); train_peak_mib: the peak over the timed steps alone. A job's step takes its slowest rank's "
    "time, after warm-up steps. fsdp_vs_hand_written: both loops built once in the same two processes, "
    "timed in alternating blocks (order swapped each round), ratio of median step times."
)


@dataclass(frozen=True)
class Work:
    width: int = 2048
    depth: int = 24
    classes: int = 16
    batch_per_device: int = 16
    warmup: int = 2  # untimed steps per launch
    steps: int = 6  # timed steps per launch
    rounds: int = 6  # alternating blocks of fsdp and the hand-written loop
    block: int = 4  # timed steps per block (after one untimed)
    lr: float = 1e-4
    seed: int = 0

    @property
    def parameters(self) -> int:
        return self.depth * (self.width * self.width + self.width) + self.width * self.classes + self.classes


def wide_mlp(width: int, depth: int, classes: int) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def run(work: Work, device: str, top: int) -> dict[str, Any]:
    """Every configuration at N = 1 and (if `top` >= 2) N = 2; see the module docstring."""
    from ..launcher import launch

    measured: dict[str, dict[str, Any]] = {c: {} for c in CONFIGS}
    measured["single"]["1"] = launch(_alone, work, "single", device, nproc=1, device=device)[0]
    measured["ddp"]["1"] = measured["fsdp"]["1"] = measured["single"]["1"]  # both run as single
    unavailable = {}
    if top >= 2:
        for config in ("ddp", "fsdp", HAND) + ((HAND_DEFAULT,) if device == "cpu" else ()):
            measured[config]["2"] = launch(_alone, work, config, device, nproc=2, device=device)[0]
        alternating = launch(_alternating, work, device, nproc=2, device=device)[0]
    else:
        alternating = None
        unavailable["N=2"] = f"one {'GPU' if device == 'cuda' else 'usable core'}: nothing to shard over"
    if device != "cpu":
        unavailable[HAND_DEFAULT] = "glibc's allocator setting concerns CPU memory only"
    return _result(work, device, measured, alternating, unavailable)


# -- inside the workers ---------------------------------------------------------------------------


def _data(work: Work, world: int, device: Any) -> tuple[Any, Any]:
    """Four global batches of inputs and labels (the same on every rank)."""
    import torch

    g = torch.Generator().manual_seed(work.seed)
    n = 4 * work.batch_per_device * world
    return torch.randn(n, work.width, generator=g).to(device), torch.randint(0, work.classes, (n,), generator=g).to(
        device
    )


def _ddpkit_side(rt: Any, work: Work) -> Callable[[], None]:
    """ddpkit's loop: one step per call."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    model = rt.build(lambda: wide_mlp(work.width, work.depth, work.classes))
    model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=work.lr))
    loader = rt.loader(
        TensorDataset(*_data(work, rt.world_size, "cpu")), batch_size=work.batch_per_device * rt.world_size
    )
    batches = _forever(loader)

    def step() -> None:
        x, y = next(batches)
        rt.backward(F.cross_entropy(model(x), y))
        rt.step(opt)

    return step


def _hand_written_side(rank: int, work: Work, device: Any) -> Callable[[], None]:
    """The FSDP2 loop as one writes it by hand: one step per call."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(work.seed)
    model = wide_mlp(work.width, work.depth, work.classes).to(device)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    x, y = _data(work, torch.distributed.get_world_size(), device)
    b = work.batch_per_device
    starts = _forever(range(rank * b, len(x), b * torch.distributed.get_world_size()))

    def step() -> None:
        i = next(starts)
        loss = F.cross_entropy(model(x[i : i + b]), y[i : i + b])
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _forever(values: Any) -> Iterator[Any]:
    while True:
        yield from values


def _alone(work: Work, config: str, device: str) -> dict[str, Any]:
    """One configuration alone in this launch: every rank's memory and step times."""
    from ..core import allocator
    from ..core.memory import peak_memory_mib, reset_peak_memory, rss_mib
    from ..observe.metrics import StepTimer
    from ..runtime import Runtime

    hand = config in (HAND, HAND_DEFAULT)
    with Runtime(strategy="ddp" if hand else config, device=device, seed=work.seed) as rt:
        if config == HAND and rt.device.type == "cpu":
            allocator.mmap_large_blocks()  # as ddpkit's fsdp does
        gc.collect()
        reset_peak_memory(rt.device)
        before = rss_mib()
        step = _hand_written_side(rt.rank, work, rt.device) if hand else _ddpkit_side(rt, work)
        setup_peak = peak_memory_mib(rt.device)
        for _ in range(work.warmup):
            step()
        peak = peak_memory_mib(rt.device)  # since the start: build, setup and the first steps
        reset_peak_memory(rt.device)
        timer = StepTimer(rt.device)
        timer.start()
        for _ in range(work.steps):
            step()
            timer.mark()
        train_peak = peak_memory_mib(rt.device)
        local = {
            "rss_before_mib": before,
            "setup_peak_mib": setup_peak,
            "train_peak_mib": train_peak,
            "peak_mib": max(peak, train_peak),
            "seconds": timer.seconds(),
            "allocator": allocator.state(),
        }
        return {
            "runs_as": rt.strategy if not hand else "fsdp2",
            "processes": rt.world_size,
            "ranks": rt.gather_objects(local),
        }


def _alternating(work: Work, device: str) -> dict[str, Any]:
    """fsdp and the hand-written loop in the same processes, in alternating timed blocks."""
    from ..observe.metrics import StepTimer
    from ..runtime import Runtime

    with Runtime(strategy="fsdp", device=device, seed=work.seed) as rt:
        steps = {"fsdp": _ddpkit_side(rt, work), HAND: _hand_written_side(rt.rank, work, rt.device)}
        times: dict[str, list[list[float]]] = {side: [] for side in steps}
        cpu: dict[str, list[float]] = {side: [] for side in steps}  # this process's CPU seconds per step
        for r in range(work.rounds):
            for side in list(steps) if r % 2 == 0 else list(steps)[::-1]:
                gc.collect()
                steps[side]()  # untimed: the other side ran last
                timer = StepTimer(rt.device)
                timer.start()
                start = time.process_time()
                for _ in range(work.block):
                    steps[side]()
                    timer.mark()
                times[side].append(timer.seconds())
                cpu[side].append((time.process_time() - start) / work.block)
        return {"ranks": rt.gather_objects({"times": times, "cpu": cpu})}


# -- assembling the result ----------------------------------------------------------------------


def _job_seconds(per_rank: list[list[float]]) -> list[float]:
    """A job's step takes its slowest rank's time."""
    return [max(step) for step in zip(*per_rank)]


def _record(m: dict[str, Any], device: str) -> dict[str, Any]:
    from .common import stats

    ranks = m["ranks"]
    return {
        "runs_as": m["runs_as"],
        "processes": m["processes"],
        "peak_mib": [r["peak_mib"] for r in ranks],
        "train_peak_mib": [r["train_peak_mib"] for r in ranks],
        "setup_peak_mib": [r["setup_peak_mib"] for r in ranks],
        "rss_before_mib": [r["rss_before_mib"] for r in ranks],
        "step_seconds": stats(_job_seconds([r["seconds"] for r in ranks])),
        "allocator": sorted({r["allocator"] for r in ranks}),
    }


def _result(
    work: Work,
    device: str,
    measured: dict[str, dict[str, Any]],
    alternating: dict[str, Any] | None,
    unavailable: dict[str, str],
) -> dict[str, Any]:
    import statistics

    from .common import stats

    configs = {c: {n: _record(m, device) for n, m in by_n.items()} for c, by_n in measured.items() if by_n}
    out: dict[str, Any] = {
        "method": METHOD,
        "memory_kind": "cuda_max_allocated" if device == "cuda" else "peak RSS (VmHWM) from the worker's start",
        "work": {**asdict(work), "parameters": work.parameters, "optimizer": "AdamW"},
        "configs": configs,
        "unavailable": unavailable,
    }
    if "2" in configs.get("fsdp", {}) and "2" in configs.get("ddp", {}):
        fsdp, ddp = configs["fsdp"]["2"], configs["ddp"]["2"]
        out["fsdp_ddp_peak_ratio"] = {
            "value": max(fsdp["peak_mib"]) / max(ddp["peak_mib"]),
            "train_only": max(fsdp["train_peak_mib"]) / max(ddp["train_peak_mib"]),
            "target": TARGET_MEMORY_RATIO,
            "note": "largest rank's peak of each, N = 2",
        }
    if alternating is not None:
        ranks = [rank["times"] for rank in alternating["ranks"]]
        per_side = {
            side: [_job_seconds([rank[side][r] for rank in ranks]) for r in range(len(ranks[0][side]))]
            for side in ("fsdp", HAND)
        }
        # CPU time of all ranks together per step, per block: less disturbed by other load on a
        # shared machine than wall time (it leaves out the time a rank waits for a core).
        cpu = {
            side: [sum(rank["cpu"][side][r] for rank in alternating["ranks"]) for r in range(len(per_side[side]))]
            for side in ("fsdp", HAND)
        }
        flat = {side: [t for block in blocks for t in block] for side, blocks in per_side.items()}
        out["fsdp_vs_hand_written"] = {
            "ratio": statistics.median(flat["fsdp"]) / statistics.median(flat[HAND]),
            "round_ratios": [
                statistics.median(f) / statistics.median(h) for f, h in zip(per_side["fsdp"], per_side[HAND])
            ],
            "fsdp_step_seconds": stats(flat["fsdp"]),
            "hand_written_step_seconds": stats(flat[HAND]),
            "cpu_ratio": statistics.median(cpu["fsdp"]) / statistics.median(cpu[HAND]),
            "round_cpu_ratios": [f / h for f, h in zip(cpu["fsdp"], cpu[HAND])],
            "fsdp_cpu_seconds_per_step": stats(cpu["fsdp"]),
            "hand_written_cpu_seconds_per_step": stats(cpu[HAND]),
            "target": TARGET_STEP_TIME_RATIO,
        }
    out["table"] = table(out)
    return out


def plot(sharded: dict[str, Any], memory: Any, steps: Any) -> None:
    """Per-rank peak memory (bars, one per rank) and median step time (quartiles) per
    configuration and N."""
    labels, peaks, train, medians, errors = [], [], [], [], []
    for config, by_n in sharded["configs"].items():
        for n, r in by_n.items():
            if n == "1" and config != "single":
                continue  # runs as single
            labels.append(f"{SHORT.get(config, config)}\nN={n}")
            peaks.append(r["peak_mib"])
            train.append(r["train_peak_mib"])
            s = r["step_seconds"]
            medians.append(s["median"])
            errors.append((s["median"] - s["q1"], s["q3"] - s["median"]))
    width = 0.8 / max(len(p) for p in peaks)
    for i, (whole, during) in enumerate(zip(peaks, train)):
        for k, (v, t) in enumerate(zip(whole, during)):
            x = i - 0.4 + width * (k + 0.5)
            memory.bar(x, v, width * 0.9, color=f"C{k}", label=f"rank {k}" if i == len(peaks) - 1 else None)
            memory.plot([x - width * 0.45, x + width * 0.45], [t, t], "k-", linewidth=1)
    memory.set_xticks(range(len(labels)), labels, fontsize=7)
    memory.set_ylabel("peak MiB per rank (bar: whole run; line: training)")
    count = sharded["work"]["parameters"]
    size = f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count:,}"
    memory.set_title(f"peak memory, {size}-parameter MLP, AdamW")
    memory.legend(fontsize=8)
    steps.bar(range(len(labels)), medians, yerr=list(zip(*errors)), capsize=3, color="C2")
    steps.set_xticks(range(len(labels)), labels, fontsize=7)
    steps.set_ylabel("seconds per step (median, quartiles)")
    title = "step time"
    if "fsdp_vs_hand_written" in sharded:
        title += f"; fsdp / FSDP2 by hand (alternating): {sharded['fsdp_vs_hand_written']['ratio']:.3f}"
    steps.set_title(title, fontsize=10)
    for ax in (memory, steps):
        ax.grid(alpha=0.3, axis="y")


def table(sharded: dict[str, Any]) -> str:
    lines = [
        "| configuration | N | runs as | peak memory per rank (MiB) | while training | step time, median (q1-q3) |",
        "|---|---|---|---|---|---|",
    ]
    for config, by_n in sharded["configs"].items():
        for n, r in by_n.items():
            s = r["step_seconds"]
            lines.append(
                f"| {config} | {n} | {r['runs_as']} | {' / '.join(f'{v:,.0f}' for v in r['peak_mib'])} | "
                f"{' / '.join(f'{v:,.0f}' for v in r['train_peak_mib'])} | "
                f"{s['median']:.2f} s ({s['q1']:.2f}-{s['q3']:.2f}) |"
            )
    return "\n".join(lines)


def summary(sharded: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if "fsdp_ddp_peak_ratio" in sharded:
        r = sharded["fsdp_ddp_peak_ratio"]
        rows.append(("fsdp / ddp peak memory, N=2", f"{r['value']:.2f} (target <= {r['target']})"))
    if "fsdp_vs_hand_written" in sharded:
        r = sharded["fsdp_vs_hand_written"]
        rows.append(("fsdp / hand-written FSDP2 step time, N=2", f"{r['ratio']:.3f} (target <= {r['target']})"))
    for config, by_n in sharded["configs"].items():
        for n, r in by_n.items():
            if n == "1" and config != "single":
                continue
            rows.append(
                (
                    f"{config} N={n} peak MiB, step s",
                    f"{max(r['peak_mib']):,.0f}, {r['step_seconds']['median']:.2f}",
                )
            )
    return rows
