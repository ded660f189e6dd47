"""`ddpkit bench layouts`: each layout of a 4-process job on ddpkit's gpt (ddp, fsdp, hsdp 2x2,
fsdp+tp 2x2, tp 4, pp 4; see docs/parallelism.md), per rank: the memory its parameters, gradients,
optimizer state and activations take, its peak, the step time, and the bytes each kind of
collective moves per step; and each layout's step time against a hand-written loop of the same
layout.

What is measured, and how:

- Parameters, gradients and AdamW's state: the bytes of the tensors this rank holds (its shards
  and slices, DTensors' local parts), counted after a step, so the optimizer's state exists.
  Gradients are counted after a backward, before the step drops them.
- Activations: the bytes autograd keeps for the backward of a step's forward, counted as each
  tensor is saved (`saved_tensors_hooks`; a DTensor's local part). A pipeline's step is its 4
  micro-batches: their sum (1F1B holds at most as many micro-batches' at once as stages).
- Peak: on CPU the process's peak RSS (VmHWM), reset before each layout is built (all layouts
  run one after the other in the same processes, so what one freed may stay in the allocator's
  heap for the next); on CUDA `max_memory_allocated`.
- Collectives: every c10d operation a step dispatches (DDP's all-reduces, FSDP2's all-gathers and
  reduce-scatters, tensor parallel's all-reduces and all-gathers), caught by a
  `TorchDispatchMode`, with the bytes of the tensors it is given: the payload a rank hands to
  each kind per step (a ring moves about 2 (N-1)/N of an all-reduce's payload per rank).
- Step time: ddpkit's loop (`Runtime(mesh=...)`, `rt.loader`, `rt.forward_backward`, `rt.step`)
  and the hand-written one (DDP, or `fully_shard` on each block and the root over its mesh, after
  `parallelize_module` with gpt's plan over `tp`, or a `PipelineStage` of each rank's blocks under
  `Schedule1F1B` over 4 micro-batches; `loss.backward()` or `schedule.step(...)`, `opt.step();
  opt.zero_grad()`)
  built once in the same processes and timed in alternating blocks, the order swapped each round;
  a job's step takes its slowest rank's time. The ratio is of the medians; its CPU-time ratio
  (the CPU seconds of all ranks per step) is less disturbed by other load on a shared machine.
"""

from __future__ import annotations

import fnmatch
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..observe.collectives import Collectives, tensor_bytes

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = (
    "ddp / fsdp / hsdp 2x2 / fsdp+tp 2x2 / tp 4 / pp 4 / pp 2 x dp 2 / pp 2 x tp 2 on 4 processes: per-rank memory "
    "(parameters, gradients, "
    "optimizer state, activations, peak), step time, bytes per collective, and each against a hand-written loop"
)
PROCESSES = 4
LAYOUTS: dict[str, tuple[str, str]] = {
    "ddp": ("ddp", "dp=4"),
    "fsdp": ("fsdp", "dp=4"),
    "hsdp 2x2": ("hsdp", "replicate=2,dp=2"),
    "fsdp+tp 2x2": ("tp", "dp=2,tp=2"),
    "tp 4": ("tp", "tp=4"),
    "pp 4": ("pp", "pp=4"),
    "pp 2 x dp 2": ("pp", "pp=2,dp=2"),
    "pp 2 x tp 2": ("pp", "pp=2,tp=2"),
}
TARGET_STEP_TIME_RATIO = 1.01  # ddpkit's loop / the hand-written loop of the same layout
PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class Work:
    width: int = 256
    depth: int = 4
    heads: int = 8
    context: int = 128
    batch: int = 16  # global: sequences per optimizer step over the data ranks
    rounds: int = 6  # alternating blocks of ddpkit's loop and the hand-written one
    block: int = 3  # timed steps per block (after one untimed)
    lr: float = 1e-3
    seed: int = 0

    def model(self) -> Any:
        from ..models import gpt

        return gpt((self.context,), 256, width=self.width, depth=self.depth, heads=self.heads)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--gpt-width", type=int, default=0, help="gpt's width (default 256; --quick 32)")
    parser.add_argument("--gpt-depth", type=int, default=0, help="gpt's blocks (default 4; --quick 2)")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default 128; --quick 16)")


def run(opts: Any, device: str) -> dict[str, Any]:
    from ..core import device as devices
    from ..launcher import launch

    extra = opts.extra
    quick = Work(width=32, depth=2, heads=4, context=16, batch=8, rounds=2, block=1)
    base = quick if opts.quick else Work()
    work = Work(
        width=extra.get("gpt_width") or base.width,
        depth=extra.get("gpt_depth") or base.depth,
        heads=base.heads,
        context=extra.get("seq_len") or base.context,
        batch=base.batch,
        rounds=opts.reps(base.rounds, quick.rounds),
        block=base.block,
    )
    available = devices.gpu_count() if device == "cuda" else PROCESSES
    if available < PROCESSES:
        return {
            "work": asdict(work),
            "unavailable": f"{PROCESSES} processes need {PROCESSES} GPUs; {available} visible",
        }
    ranks = launch(_worker, work, nproc=PROCESSES, device=device)
    return _result(work, device, ranks)


# -- inside the workers ---------------------------------------------------------------------------


def _worker(work: Work) -> dict[str, Any]:
    from ..runtime import Runtime

    with Runtime(device="auto", seed=work.seed) as outer:  # holds the group every layout uses
        out = {name: _layout(work, strategy, mesh) for name, (strategy, mesh) in LAYOUTS.items()}
        return outer.gather_objects(out)


def _layout(work: Work, strategy: str, mesh: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from ..core.memory import peak_memory_mib, reset_peak_memory
    from ..runtime import Runtime

    with Runtime(strategy, seed=work.seed, mesh=mesh) as rt:
        gc.collect()
        reset_peak_memory(rt.device)
        model = rt.build(work.model)
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=work.lr))
        data = _tokens(work, rt.data_world_size)
        # A pipeline's micro-batches: as many as stages (the hand-written schedule's too).
        stages = rt.layout.spec.size("pp")
        micro = work.batch // rt.data_world_size // stages if rt.pipelined else None
        batches = _forever(rt.loader(data, batch_size=work.batch, micro_batch_size=micro))

        def loss_fn(out: Any, y: Any) -> Any:
            return F.cross_entropy(out.flatten(0, 1), y.flatten())

        def backward() -> None:  # a step's micro-batches, forward and backward
            while True:
                x, y = next(batches)
                rt.forward_backward(model, x, y, loss_fn)
                if rt.step_ready:
                    return

        def ddpkit_step() -> None:
            backward()
            rt.step(opt)

        activations = _saved_bytes(backward)
        gradients = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        rt.step(opt)
        with Collectives() as counted:
            ddpkit_step()
        memory = {
            "parameters": tensor_bytes(model.parameters()),
            "gradients": gradients,
            "optimizer": tensor_bytes(t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)),
            "activations": activations,
            "peak_mib": peak_memory_mib(rt.device),
        }
        hand_step = _hand_written(work, strategy, mesh, rt)
        times: dict[str, list[list[float]]] = {"ddpkit": [], "hand": []}
        cpu: dict[str, list[float]] = {"ddpkit": [], "hand": []}
        sides = {"ddpkit": ddpkit_step, "hand": hand_step}
        for r in range(work.rounds):
            for side in ("ddpkit", "hand") if r % 2 == 0 else ("hand", "ddpkit"):
                gc.collect()
                sides[side]()  # untimed: the other side ran last
                seconds, start = [], time.process_time()
                for _ in range(work.block):
                    t0 = time.perf_counter()
                    sides[side]()
                    _sync(rt.device)
                    seconds.append(time.perf_counter() - t0)
                times[side].append(seconds)
                cpu[side].append((time.process_time() - start) / work.block)
        return {
            "runs_as": rt.strategy,
            "mesh": str(rt.layout.spec),
            "where": rt.layout.where(rt.rank),
            "memory": memory,
            "collectives": counted.bytes,
            "calls": counted.calls,
            "times": times,
            "cpu": cpu,
        }


def _hand_written(work: Work, strategy: str, mesh: str, rt: Any) -> Callable[[], None]:
    """The same layout as one writes it with torch alone: one step per call."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from ..strategy import MeshSpec

    spec = MeshSpec.parse(mesh)
    torch.manual_seed(work.seed)
    model = work.model().to(rt.device)
    shape, names = spec.grid()
    grid = init_device_mesh(rt.device.type, shape, mesh_dim_names=names)
    if strategy == "pp":
        return _hand_written_pipeline(work, model, grid, spec, rt)
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        if "tp" in spec.names:
            parallelize_module(model, grid["tp"], model.tp_plan(spec.size("tp")))
        shard_over = grid["replicate", "dp"] if "replicate" in spec.names else grid["dp"]
        if strategy != "tp" or spec.size("dp") > 1:
            for block in model.children():
                fully_shard(block, mesh=shard_over)
            fully_shard(model, mesh=shard_over)
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    x, y = _tokens(work, spec.data_size).tensors
    share = work.batch // spec.data_size
    rank = spec.data_rank(tdist.get_rank())
    starts = _forever(range(rank * share, len(x) - share + 1, work.batch))

    def step() -> None:
        i = next(starts)
        loss = F.cross_entropy(
            model(x[i : i + share].to(rt.device)).flatten(0, 1), y[i : i + share].to(rt.device).flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _hand_written_pipeline(work: Work, model: Any, grid: Any, spec: Any, rt: Any) -> Callable[[], None]:
    """gpt's children cut where ddpkit cuts them, this rank's kept, its layers split over tp
    (pp x tp) or the stage under DDP over dp (pp x dp); torch's PipelineStage and Schedule1F1B
    over as many micro-batches as stages; each data rank reads its share of the batch."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import parallelize_module

    from ..strategy.pp import balanced_cuts

    group = grid["pp"].get_group()
    index, stages = torch.distributed.get_rank(group), grid["pp"].size()
    names = [name for name, _ in model.named_children()]
    bounds = balanced_cuts([sum(p.numel() for p in c.parameters()) for c in model.children()], stages)
    for name in names[: bounds[index]] + names[bounds[index + 1] :]:
        del model._modules[name]
    if spec.size("tp") > 1:
        kept = list(model._modules)  # the plan's entries for this stage's children
        plan = {k: v for k, v in model.tp_plan(spec.size("tp")).items() if fnmatch.filter(kept, k.split(".")[0])}
        parallelize_module(model, grid["tp"], plan)
    submodule = model
    if spec.size("dp") > 1:  # (find_unused_parameters: DDP's bucket rebuild fails under torch's schedules)
        submodule = torch.nn.parallel.DistributedDataParallel(
            model, process_group=grid["dp"].get_group(), find_unused_parameters=True
        )
    stage = PipelineStage(submodule, index, stages, rt.device, group=group)

    def loss_fn(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    schedule = Schedule1F1B(stage, stages, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr)
    x, y = _tokens(work, spec.data_size).tensors
    share = work.batch // spec.data_size
    rank = spec.data_rank(tdist.get_rank())
    starts = _forever(range(rank * share, len(x) - share + 1, work.batch))

    def step() -> None:
        i = next(starts)
        if index == 0:
            schedule.step(x[i : i + share].to(rt.device))
        elif index == stages - 1:
            schedule.step(target=y[i : i + share].to(rt.device))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    return step


def _tokens(work: Work, data_ranks: int) -> Any:
    """Eight global batches of random byte sequences and their next bytes (the same on every rank)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(work.seed)
    seq = torch.randint(0, 256, (8 * work.batch, work.context + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def _forever(values: Any) -> Iterator[Any]:
    while True:
        yield from values


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _saved_bytes(backward: Callable[[], None]) -> int:
    """The bytes autograd keeps for the backward of the forwards `backward()` runs."""
    import torch

    total = 0

    def pack(t: Any) -> Any:
        nonlocal total
        total += tensor_bytes([t])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backward()
    return total


# -- assembling the result ----------------------------------------------------------------------


def _job_seconds(per_rank: list[list[float]]) -> list[float]:
    """A job's step takes its slowest rank's time."""
    return [max(step) for step in zip(*per_rank)]


def _result(work: Work, device: str, ranks: dict[int, Any]) -> dict[str, Any]:
    from .common import stats

    every = ranks[0]  # rank 0 gathered every rank's layouts
    layouts: dict[str, Any] = {}
    for name in LAYOUTS:
        rs = [rank[name] for rank in every]
        blocks = {
            side: [_job_seconds([r["times"][side][b] for r in rs]) for b in range(len(rs[0]["times"][side]))]
            for side in ("ddpkit", "hand")
        }
        flat = {side: [t for block in blocks[side] for t in block] for side in blocks}
        cpu = {side: [sum(r["cpu"][side][b] for r in rs) for b in range(len(blocks[side]))] for side in blocks}
        layouts[name] = {
            "strategy": rs[0]["runs_as"],
            "mesh": rs[0]["mesh"],
            "where": [r["where"] for r in rs],
            "memory_mib": {part: [r["memory"][part] / 2**20 for r in rs] for part in PARTS},
            "peak_mib": [r["memory"]["peak_mib"] for r in rs],
            "collective_bytes_per_step": [r["collectives"] for r in rs],
            "collective_calls_per_step": [r["calls"] for r in rs],
            "step_seconds": stats(flat["ddpkit"]),
            "hand_written_step_seconds": stats(flat["hand"]),
            "vs_hand_written": {
                "ratio": statistics.median(flat["ddpkit"]) / statistics.median(flat["hand"]),
                "round_ratios": [
                    statistics.median(d) / statistics.median(h) for d, h in zip(blocks["ddpkit"], blocks["hand"])
                ],
                "cpu_ratio": statistics.median(cpu["ddpkit"]) / statistics.median(cpu["hand"]),
                "target": TARGET_STEP_TIME_RATIO,
            },
        }
    return {
        "work": {**asdict(work), "processes": PROCESSES, "optimizer": "AdamW", "model": "gpt"},
        "memory_kind": "cuda_max_allocated" if device == "cuda" else "peak RSS (VmHWM), reset before each layout",
        "layouts": layouts,
        "table": table(layouts),
    }


def table(layouts: dict[str, Any]) -> str:
    lines = [
        "| layout | mesh | MiB per rank: parameters / gradients / optimizer / activations (rank 0) | peak MiB | "
        "collective MiB per step (rank 0) | step s (median) | / hand-written (CPU time) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in layouts.items():
        parts = " / ".join(f"{r['memory_mib'][p][0]:.1f}" for p in PARTS)
        comm = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(r["collective_bytes_per_step"][0].items())) or "none"
        v = r["vs_hand_written"]
        lines.append(
            f"| {name} | {r['mesh']} | {parts} | {max(r['peak_mib']):,.0f} | {comm} | "
            f"{r['step_seconds']['median']:.3f} | {v['ratio']:.3f} ({v['cpu_ratio']:.3f}) |"
        )
    return "\n".join(lines)


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    if "layouts" not in r:
        return
    layouts = r["layouts"]
    names = list(layouts)
    fig, (memory, steps, comm) = plt.subplots(1, 3, figsize=(15, 4.6))
    bottom = [0.0] * len(names)
    for k, part in enumerate(PARTS):
        values = [layouts[n]["memory_mib"][part][0] for n in names]
        memory.bar(names, values, bottom=bottom, color=f"C{k}", label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    memory.plot(names, [max(layouts[n]["peak_mib"]) for n in names], "k_", markersize=20, label="peak (largest rank)")
    memory.set_ylabel("MiB on rank 0")
    memory.set_title("memory per rank", fontsize=10)
    memory.legend(fontsize=8)
    x = range(len(names))
    for offset, side, label in ((-0.2, "step_seconds", "ddpkit"), (0.2, "hand_written_step_seconds", "by hand")):
        med = [layouts[n][side]["median"] for n in names]
        err = [
            [m - layouts[n][side]["q1"] for m, n in zip(med, names)],
            [layouts[n][side]["q3"] - m for m, n in zip(med, names)],
        ]
        steps.bar([i + offset for i in x], med, 0.4, yerr=err, capsize=3, label=label)
    for i, n in enumerate(names):
        steps.annotate(f"{layouts[n]['vs_hand_written']['ratio']:.3f}", (i, 0), ha="center", va="bottom", fontsize=8)
    steps.set_xticks(list(x), names)
    steps.set_ylabel("seconds per step (median, quartiles)")
    steps.set_title("step time; label: ddpkit / by hand", fontsize=10)
    steps.legend(fontsize=8)
    kinds = sorted({k for n in names for k in layouts[n]["collective_bytes_per_step"][0]})
    bottom = [0.0] * len(names)
    for k, kind in enumerate(kinds):
        values = [layouts[n]["collective_bytes_per_step"][0].get(kind, 0) / 2**20 for n in names]
        comm.bar(names, values, bottom=bottom, color=f"C{k}", label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    comm.set_ylabel("MiB handed to collectives per step, rank 0")
    comm.set_title("communication", fontsize=10)
    comm.legend(fontsize=8)
    for ax in (memory, steps, comm):
        ax.tick_params(axis="x", labelsize=8, labelrotation=35)  # eight names side by side
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(alpha=0.3, axis="y")
    w = r["work"]
    fig.suptitle(
        f"layouts of {w['processes']} processes: gpt width {w['width']}, {w['depth']} blocks, {w['context']} tokens, "
        f"global batch {w['batch']}, AdamW"
    )
    save_figure(fig, path)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    if "layouts" not in result:
        return [("layouts", "unavailable: " + result.get("unavailable", ""))]
    rows = []
    for name, r in result["layouts"].items():
        v = r["vs_hand_written"]
        rows.append((f"{name} step s (/ by hand)", f"{r['step_seconds']['median']:.3f} ({v['ratio']:.3f})"))
    return rows
