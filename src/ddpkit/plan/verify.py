"""`ddpkit plan --verify`: the plan's layouts run for real here, one step each, beside what the
plan predicted for them on a cluster of this machine's processes.

Measured: each layout runs through ddpkit's `Runtime` on `nproc` processes (gloo on CPU, NCCL on
GPUs), all layouts one after the other in one job of fresh processes (forked from a fork server of
the job's own, which imported torch once). After a first
step (the optimizer's state exists from then on, as in the trace), one more step runs under the
same torch memory tracker the plan uses, on real tensors: `FSDPMemTracker` where FSDP2 shards,
else `MemTracker`. DDP's gradient buckets are allocated by its C++ reducer, out of the
tracker's sight until their first all-reduce hands them through a torch operation; two steps
are tracked, so that the second counts them throughout, and their bytes (DDP's own
`bucket_sizes`) are reported as communication rather than as the temporaries the tracker took
them for. A rank's figure is its own; the plan's is rank 0's, the one compared (a pipeline's
stages: each rank's, `measured_ranks`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from ..core import checks
from ..errors import UsageError
from .pipeline import stage_ranks
from .run import Spec, _traced, _traced_stage, children
from .trace import Layout, Step, backend_for, in_fake_worlds, loss, memory_tracker, optimizer, roles

# Imports inside functions: the Runtime and the launcher load when a verification runs.


Case = tuple[Spec, Layout]  # a job, and the layout it runs in


@dataclass(frozen=True)
class Job:
    cases: tuple[Case, ...]
    timed_steps: int = 3


def predicted(cases: list[Case], nproc: int, device: str = "cpu") -> list[Any]:
    """The plan's trace of each case on `nproc` ranks, with the optimizer torch picks on CPU
    (one tensor at a time), as the real runs here have it, and the process group `measured`
    runs on `device` (gloo on the CPU, whose reduce-scatter copies its input: `GlooCopies`).
    A pipeline's is the list of its stages' traces, first stage first (`pipeline.trace_stage`):
    stage s is that of rank `pipeline.stage_ranks(layout, s)[0]`."""
    backend = backend_for(device)
    calls, counts = [], []
    for spec, layout in cases:
        stages = layout.spec.size("pp") if layout.strategy == "pp" else 0
        calls += [(_traced_case, (spec, layout, nproc, backend, s)) for s in range(max(stages, 1))]
        counts.append(stages)
    traces = iter(in_fake_worlds(nproc, calls))
    return [[next(traces) for _ in range(n)] if n else next(traces) for n in counts]


def _traced_case(spec: Spec, layout: Layout, nproc: int, backend: str, stage: int = 0) -> Any:
    share = spec.share(layout.spec.data_size)
    assert share is not None, layout
    step = Step(
        spec.build, spec.batch, share, spec.precision, spec.optimizer, foreach=False, count=True, backend=backend
    )
    if layout.strategy == "pp":
        return _traced_stage(spec, step, layout, nproc, stage)
    return _traced(spec, step, layout, nproc)


def measured(cases: list[Case], nproc: int, device: str = "cpu", timed_steps: int = 3) -> list[dict[str, Any]]:
    """Each case's real steps on `nproc` processes, one job for all: rank 0's tracked memory by
    role and peak (bytes), and the median seconds of `timed_steps` steps."""
    return measured_ranks(cases, nproc, device, timed_steps)[0]


def measured_ranks(
    cases: list[Case], nproc: int, device: str = "cpu", timed_steps: int = 3
) -> list[list[dict[str, Any]]]:
    """`measured`, of every rank (rank r's cases at [r]): each stage of a pipeline is a rank."""
    from ..launcher import launch

    # Never forked from here: a forked worker inherits the launching process's torch state
    # (DTensor's caches among it), and tensor-parallel peaks measured after a long process
    # history (a whole test suite's) were 6% and 20% above the same runs in a fresh process.
    # Forked from the job's fork server instead, a fresh process that imported torch once: a
    # spawned worker's state (the same peaks to the byte) without each worker importing torch.
    with mock.patch.dict(os.environ, {"DDPKIT_START_METHOD": "forkserver"}):  # restored afterwards
        ranks = launch(_worker, Job(tuple(cases), timed_steps), nproc=nproc, device=device)
    return [ranks[r] for r in sorted(ranks)]


def _worker(job: Job) -> list[dict[str, Any]]:
    from ..runtime import Runtime

    with Runtime(device="auto") as outer:  # holds the group every layout's Runtime uses
        rows = [_one(job, spec, layout) for spec, layout in job.cases]
        outer.barrier()
        return rows


def _one(job: Job, spec: Spec, layout: Layout) -> dict[str, Any]:
    from ..runtime import Runtime
    from ..strategy.pp import stage_of

    with Runtime(
        layout.strategy,
        seed=0,
        mesh=layout.mesh,
        precision=spec.precision,
        activation_checkpointing=True if layout.checkpointing else None,
        activation_checkpointing_mode=layout.checkpointing_mode or "full",
        pp_schedule=layout.schedule,
    ) as rt:
        model = rt.build(spec.build)
        model, opt = rt.setup(model, optimizer(spec.optimizer, model, foreach=rt.device.type == "cuda"))
        x, y = spec.batch(spec.global_batch * (4 + job.timed_steps))  # one pass: every step's batch
        data = torch.utils.data.TensorDataset(x, y)
        loader = rt.loader(data, batch_size=spec.global_batch, micro_batch_size=layout.micro_batch)
        batches = iter(loader)

        tracker: Any = None

        def step() -> None:
            while True:
                x, y = next(batches)
                if tracker is not None:
                    tracker.reset_mod_stats()  # per-module figures only (one forward each): the peak stays
                rt.forward_backward(model, x, y, loss)
                if rt.step_ready:
                    break
            rt.step(opt)
            opt.zero_grad(set_to_none=True)

        step()  # the optimizer's state exists from here on
        step()  # DDP rebuilds its buckets at the start of the second step: tracked steps see none made
        # FSDP2's where it shards; a pipeline's stage runs once per micro-batch: the tracker that takes that
        tracker = memory_tracker(model, opt, per_call=stage_of(model) is not None)
        with tracker:
            step()  # DDP's buckets come into view at their first all-reduce here...
            step()  # ...and are counted all through this one
        memory, tracker = roles(tracker), None
        buckets = min(_ddp_buckets(model), memory["temporary"])
        memory["temporary"] -= buckets  # the tracker saw DDP's buckets as temporaries
        memory["communication"] += buckets
        seconds = []
        for _ in range(job.timed_steps):
            t0 = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t0)
        return {
            "layout": layout.label,
            "memory": memory,
            "peak": sum(memory.values()),
            "step_s": statistics.median(seconds),
            "steps_s": seconds,
            "threads": torch.get_num_threads(),  # each process's (ddpkit.core.threads chose it)
        }


def _ddp_buckets(model: torch.nn.Module) -> float:
    """The bytes of DDP's gradient buckets, as DDP reports them: the model's, or under pp x dp
    its stage's (0 for any other model)."""
    from ..strategy.pp import stage_of  # (with the Runtime, where a verification runs)

    stage = stage_of(model)
    if stage is not None and stage.pipeline is not None and stage.pipeline.replicas is not None:
        model = stage.pipeline.replicas
    logging = getattr(model, "_get_ddp_logging_data", None)
    if logging is None:
        return 0.0
    sizes = logging().get("bucket_sizes", "")
    return float(sum(int(s) for s in str(sizes).split(",") if s.strip()))


def processes(layout: Layout, available: int) -> int:
    """The processes `--verify` runs `layout` on by default, of the `available` GPUs (or 2 on
    the CPU): all of them, but a pipeline's, a stage per process, no more than it planned (of
    pipelines beside each other, as many as the processes hold whole)."""
    if layout.strategy == "pp" and layout.spec.size("tp") > 1:  # pp x tp as planned; as many pipelines as fit (3-D)
        one = layout.spec.processes // layout.spec.data_size
        return one * min(layout.spec.data_size, max(1, available // one))
    if layout.strategy != "pp" or _side_by_side(layout, available):
        return available
    return min(available, layout.spec.size("pp"))


def _side_by_side(layout: Layout, nproc: int) -> bool:
    """Whether `nproc` processes run pipelines of `layout` (planned beside dp) side by side: two
    or more of them, whole."""
    stages = layout.spec.size("pp")
    return layout.spec.data_size > 1 and nproc > stages and nproc % stages == 0


def here(spec: Spec, layout: Layout, nproc: int) -> Case:
    """`layout` of `spec` brought to `nproc` processes on this machine: the same strategy over
    them (hsdp as 2 replicas where nproc is even and at least 4, else fsdp; tp over at most
    nproc ranks; pipelines of as many stages where nproc holds two or more of them whole,
    else one of a stage per process; pp x tp as planned, as many of its pipelines as nproc
    holds), the same micro-batch and micro-batches per step, so the
    global batch is scaled to the data ranks here."""
    from ..strategy.mesh import MeshSpec

    strategy, tp = layout.strategy, layout.spec.size("tp")
    share = spec.share(layout.spec.data_size) or layout.micro_batch  # a data rank's (a pipeline's) samples
    if strategy == "hsdp" and (nproc < 4 or nproc % 2):
        strategy = "fsdp"
    if strategy == "tp":
        tp = min(tp, nproc)
        while nproc % tp:
            tp //= 2
        strategy = "tp" if tp > 1 else "fsdp"  # no tensor parallel on an odd count: said by the caller
        mesh = f"dp={nproc // tp},tp={tp}" if tp > 1 else f"dp={nproc}"
    elif strategy == "hsdp":
        mesh = f"replicate=2,dp={nproc // 2}"
    elif strategy == "pp" and tp > 1:  # pp x tp as planned, its pipelines side by side where nproc holds them (3-D)
        stages = layout.spec.size("pp")
        one, data = stages * tp, nproc // (stages * tp)
        if nproc % one or data > layout.spec.data_size:
            most = one * layout.spec.data_size
            raise UsageError(
                f"--verify on {nproc} process(es): {layout.label} runs here as pipelines of {stages} stages of "
                f"{tp} tp ranks each, side by side; give --verify-nproc {one}"
                + (f" (or a multiple of it up to {most})" if most > one else "")
            )
        mesh = f"pp={stages},tp={tp}" if data == 1 else f"pp={stages},dp={data},tp={tp}"
    elif strategy == "pp":  # its pipelines where the processes hold them whole, else a stage per process
        stages, several = layout.spec.size("pp"), _side_by_side(layout, nproc)
        mesh = f"pp={stages},dp={nproc // stages}" if several else f"pp={nproc}"
        if layout.schedule == "gpipe":  # (it runs fewer micro-batches than stages)
            most, limits = children(spec), "the model's children"
        else:
            most, limits = (
                min(share // layout.micro_batch, children(spec)),
                "its micro-batches and the model's children",
            )
        if not several and not 2 <= nproc <= most:
            beside = f", or its pipelines side by side on a multiple of {stages}" if layout.spec.data_size > 1 else ""
            raise UsageError(
                f"--verify on {nproc} process(es): {layout.label} runs here as a pipeline of a stage per process, "
                f"from 2 to {most} ({limits}){beside}; give --verify-nproc"
            )
    else:
        mesh = f"dp={nproc}"
    scaled = Spec(
        spec.model,
        spec.in_shape,
        spec.num_classes,
        share * MeshSpec.parse(mesh).data_size,
        spec.precision,
        spec.optimizer,
        spec.options,
        spec.checkpointing,
    )
    return scaled, Layout(strategy, mesh, layout.checkpointing, layout.micro_batch, layout.schedule)


def compare(case: Case, nproc: int, device: str) -> tuple[Any, dict[str, Any]]:
    """The case's trace and its real run here (`nproc` processes on `device`). A run whose
    traced peak alone does not fit in what this machine (or each GPU) has free is refused
    first: `UsageError`, one line, instead of an out-of-memory error in every worker."""
    guessed = predicted([case], nproc, device)[0]
    if isinstance(guessed, list):  # a pipeline's stages: the one that holds most, beside its rank
        stage = max(range(len(guessed)), key=lambda s: guessed[s].peak)
        fits_here(guessed[stage].peak, nproc, device, f"--verify's run of {case[1].label}")
        return guessed[stage], measured_ranks([case], nproc, device)[stage_ranks(case[1], stage)[0]][0]
    fits_here(guessed.peak, nproc, device, f"--verify's run of {case[1].label}")
    return guessed, measured([case], nproc, device)[0]


def fits_here(peak: float, nproc: int, device: str, what: str) -> None:
    """Refuse `what` where `nproc` processes of `peak` bytes each cannot fit: on a GPU, in the
    first GPU's free memory (each process has one of its own); on the CPU, in the memory the
    machine can still give out, all of them together. The peak counts tensors only (not the
    runtime's own memory): what fits here may still not fit once running."""
    if device != "cuda":
        checks.memory(what, peak, nproc)
        return
    free, _ = torch.cuda.mem_get_info(0)
    if peak > free:
        raise UsageError(
            f"{what} needs about {peak / 2**30:,.1f} GiB on each GPU (its traced peak); "
            f"{free / 2**30:,.1f} GiB is free on GPU 0"
        )
