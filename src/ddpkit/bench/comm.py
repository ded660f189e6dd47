"""`ddpkit bench comm`: DDP's communication knobs, each measured on the same work.

Variants (ddpkit's `DDPOptions`, the flags of `ddpkit train`):

  default                    torch's defaults (25 MiB buckets), gradients all-reduced in fp32
  bucket_cap_mb=1 / 5 / 100  smaller or larger gradient buckets
  gradient_as_bucket_view    gradients are views into the buckets (one copy less per step)
  static_graph               DDP may skip re-checking which parameters were used
  comm_hook=fp16 / bf16      gradients compressed to 16 bits for the all-reduce

Bytes are measured, not computed from the model: every variant runs with a counting
communication hook registered on `rt.ddp` (in place of the runtime's own hook: DDP takes one,
registered before the first forward). The counter wraps torch's own hook for the variant --
`allreduce_hook` (what DDP does without a hook), `fp16_compress_hook` or `bf16_compress_hook`
-- and adds up, for every bucket DDP hands it, the size of the tensor that hook all-reduces:
the bucket's elements times the element size on the wire (the gradient's own dtype, or 2 bytes
for the compressed hooks). So "bytes per step" is the payload each rank hands to all-reduce per
optimizer step (a ring all-reduce moves about 2 (N-1)/N times that per rank); "buckets per
step" is how many all-reduce calls it takes. DDP's broadcast of BatchNorm buffers in each
forward (a few KiB for ResNet-18) is not a gradient all-reduce and is not counted.

All variants live side by side in the same worker processes, built from the same seed, and are
timed round-robin -- one block of steps of each per round, the order rotated every round -- so
that a machine's slow minute falls on all of them alike. A block is timed on every rank after
the variant's warm-up steps (which include DDP's bucket rebuild after its first step); the
block's time for the job is its slowest rank's.

CPU runs 2 gloo processes with small images and batches (compute must not drown out the
communication of ResNet-18's 11 M gradients, 45 MB in fp32); CUDA runs one process per GPU
over NCCL and needs at least 2 GPUs. A hook whose dtype the backend cannot all-reduce is
reported as unavailable with the backend's exact error, not as a number.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

from .common import cycle

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = (
    "DDP bucket size, gradient_as_bucket_view, static_graph, fp16/bf16 comm hooks: step time and bytes all-reduced"
)

# name -> DDPOptions fields; "comm_hook" names the torch hook the counter wraps (none: allreduce_hook)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "bucket_cap_mb=1": {"bucket_cap_mb": 1.0},
    "bucket_cap_mb=5": {"bucket_cap_mb": 5.0},
    "bucket_cap_mb=100": {"bucket_cap_mb": 100.0},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "comm_hook=fp16": {"comm_hook": "fp16"},
    "comm_hook=bf16": {"comm_hook": "bf16"},
}


@dataclass(frozen=True)
class Work:
    model: str
    image_size: int
    batch_per_rank: int
    steps_per_repeat: int  # optimizer steps in one timed block
    warmup_steps: int = 3  # per variant, before any timing (DDP rebuilds its buckets after the first)
    classes: int = 10
    lr: float = 0.01  # BatchNorm over a few samples per rank: a gentle rate keeps the loss sane
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="resnet18", help="built-in model (default resnet18: 11 M parameters)")
    parser.add_argument(
        "--image-size",
        type=int,
        default=0,
        help="synthetic images 3 x SIZE x SIZE (default 32 on CUDA; 16 on CPU, --quick 8)",
    )
    parser.add_argument(
        "--batch-per-rank",
        type=int,
        default=0,
        help="samples per process per step (default 64 on CUDA; 8 on CPU, --quick 4)",
    )
    parser.add_argument("--nproc", type=int, default=0, help="processes (default: 2 on CPU, one per GPU on CUDA)")


def run(opts: Any, device: str) -> dict[str, Any]:
    import torch

    from ..core import checks
    from ..errors import UsageError
    from ..launcher import launch
    from ..models import check

    extra, cuda, quick = opts.extra, device == "cuda", opts.quick
    work = Work(
        model=extra.get("model", "resnet18"),
        image_size=extra.get("image_size") or (32 if cuda else (8 if quick else 16)),
        batch_per_rank=extra.get("batch_per_rank") or (64 if cuda else (4 if quick else 8)),
        steps_per_repeat=10 if cuda else 2,
        warmup_steps=2 if quick else 3,
    )
    check(work.model, work.shape)
    checks.positive("--batch-per-rank", work.batch_per_rank)
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = extra.get("nproc") or (gpus if cuda else 2)
    if cuda and nproc > gpus:
        raise UsageError(f"--nproc {nproc}: only {gpus} GPU(s) visible (NCCL takes one process per GPU)")
    reps = opts.reps(10 if cuda else 8, 3)
    if nproc < 2:
        return _unavailable(work, device, nproc)
    ranks = launch(_worker, work, device, reps, nproc=nproc, device=device)[0]
    return _result(work, device, nproc, reps, ranks)


def _unavailable(work: Work, device: str, nproc: int) -> dict[str, Any]:
    why = f"DDP communication needs at least 2 processes; {nproc} on {device}" + (
        " (NCCL takes one process per GPU: this machine shows one GPU; `--device cpu` measures 2 gloo processes)"
        if device == "cuda"
        else ""
    )
    return {"method": why, "work": asdict(work), "nproc": nproc, "variants": [], "unavailable": {"all": why}}


# -- inside the workers ---------------------------------------------------------------------------


class Counter:
    """State of the counting hook: torch's hook for the variant, and what it all-reduced."""

    def __init__(self, hook: str):
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.hook = {
            "none": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }[hook]
        self.wire_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[hook]
        self.steps: list[list[int]] = []  # bytes of every bucket all-reduced, per step

    def new_step(self) -> None:
        self.steps.append([])


def counting_hook(counter, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: count the bucket's bytes as they go on the wire, then run torch's hook.
    No annotations: DDP checks a hook's `bucket` and return annotations against the real
    types, and under `from __future__ import annotations` they would be strings."""
    buffer = bucket.buffer()
    dtype = counter.wire_dtype or buffer.dtype
    counter.steps[-1].append(buffer.numel() * dtype.itemsize)
    return counter.hook(None, bucket)  # None: the default process group


class Setup:
    """One variant: its runtime (for its DDPOptions), model, optimizer, batches and counter."""

    def __init__(self, work: Work, name: str, data: Any, device: str):
        import torch

        from ..models import build
        from ..runtime import Runtime
        from ..strategy import DDPOptions

        fields = dict(VARIANTS[name])
        self.counter = Counter(fields.pop("comm_hook", "none"))
        # The process group exists already (the worker's outer runtime owns it): this runtime
        # only carries the variant's DDP options, and the counting hook replaces its comm_hook.
        self.rt = Runtime(strategy="ddp", device=device, seed=work.seed, ddp=DDPOptions(comm_hook="none", **fields))
        model = build(work.model, work.shape, work.classes)
        self.gradient_elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.model, self.opt = self.rt.setup(model, torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9))
        self.rt.ddp.register_comm_hook(state=self.counter, hook=counting_hook)  # before the first forward
        self.batches = cycle(self.rt.loader(data, batch_size=work.batch_per_rank * self.rt.world_size, resident=True))
        self.loss: Any = None

    def steps(self, n: int) -> None:
        import torch.nn.functional as F

        for _ in range(n):
            x, y = next(self.batches)
            self.counter.new_step()
            loss = F.cross_entropy(self.model(x), y)
            self.rt.backward(loss)
            self.rt.step(self.opt)
            self.loss = loss.detach()


def _probe(dtype: Any, device: Any) -> str | None:
    """None if the backend all-reduces `dtype`, else its exact error."""
    import torch
    import torch.distributed as tdist

    try:
        tdist.all_reduce(torch.ones(4, dtype=dtype, device=device))
        return None
    except Exception as err:  # noqa: BLE001 - reported as the variant's result
        return f"{type(err).__name__}: {err}".strip()


def _worker(work: Work, device: str, reps: int) -> list[dict[str, Any]]:
    import torch

    from ..data import synthetic
    from ..observe.metrics import time_calls
    from ..runtime import Runtime

    with Runtime(strategy="ddp", device=device) as base:  # owns the process group
        data = synthetic(work.shape, work.batch_per_rank * base.world_size * 8, work.classes, work.seed).train
        unavailable = {}
        for name, dtype in (("comm_hook=fp16", torch.float16), ("comm_hook=bf16", torch.bfloat16)):
            error = _probe(dtype, base.device)
            if error:
                unavailable[name] = f"{dtype} all-reduce on {torch.distributed.get_backend()}: {error}"
        setups = {name: Setup(work, name, data, device) for name in VARIANTS if name not in unavailable}
        for s in setups.values():
            s.steps(work.warmup_steps)
        for s in setups.values():
            s.counter.steps.clear()  # count the timed steps only: after DDP's bucket rebuild
        seconds: dict[str, list[float]] = {name: [] for name in setups}
        names = list(setups)
        for r in range(reps):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                block = functools.partial(setups[name].steps, work.steps_per_repeat)
                seconds[name] += time_calls(block, base.device, repeats=1, warmup=0)
        local = {
            "threads": torch.get_num_threads(),
            "backend": torch.distributed.get_backend(),
            "unavailable": unavailable,
            "variants": {},
        }
        for name, s in setups.items():
            local["variants"][name] = {
                "seconds": seconds[name],
                "bucket_bytes": s.counter.steps,
                "final_loss": s.loss.item(),
                "gradient_elements": s.gradient_elements,
                "grad_dtype_bytes": next(s.model.parameters()).element_size(),
                "wire_dtype": str(s.counter.wire_dtype or next(s.model.parameters()).dtype).replace("torch.", ""),
            }
            s.rt.close()
        return base.gather_objects(local)


# -- assembling the result ------------------------------------------------------------------------


def _variant(work: Work, nproc: int, name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    from .common import stats

    per = [r["variants"][name] for r in ranks]
    blocks = [max(t) for t in zip(*(p["seconds"] for p in per))]  # slowest rank's time per block
    step_s = [b / work.steps_per_repeat for b in blocks]
    steps = per[0]["bucket_bytes"]  # identical on every rank: the same buckets all-reduce together
    totals = sorted({sum(s) for s in steps})
    counts = sorted({len(s) for s in steps})
    losses = [p["final_loss"] for p in per]
    return {
        "variant": name,
        "ddp_options": {**VARIANTS[name], "comm_hook": VARIANTS[name].get("comm_hook", "none")},
        "wire_dtype": per[0]["wire_dtype"],
        "step_ms": stats([s * 1e3 for s in step_s]),
        "samples_per_second": stats([work.batch_per_rank * nproc / s for s in step_s]),
        "bytes_per_step": totals[-1],
        "mb_per_step": totals[-1] / 1e6,
        "bytes_per_step_constant": len(totals) == 1 and all(p["bucket_bytes"] == steps for p in per),
        "buckets_per_step": counts[-1],
        "bucket_mb": [b / 1e6 for b in steps[-1]],
        "counted_steps": len(steps),
        "gradient_elements": per[0]["gradient_elements"],
        "bytes_per_gradient_element": totals[-1] / per[0]["gradient_elements"],
        "final_loss": sum(losses) / len(losses),
        "final_loss_per_rank": losses,
        "loss_finite": all(math.isfinite(v) for v in losses),
    }


def _result(work: Work, device: str, nproc: int, reps: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    unavailable = ranks[0]["unavailable"]
    variants = [_variant(work, nproc, name, ranks) for name in VARIANTS if name not in unavailable]
    default = variants[0]
    for v in variants:
        v["step_time_vs_default"] = v["step_ms"]["median"] / default["step_ms"]["median"]
        v["bytes_vs_default"] = v["bytes_per_step"] / default["bytes_per_step"]
    elements = default["gradient_elements"]
    return {
        "method": (
            f"{nproc} {ranks[0]['backend']} processes ({device}), {ranks[0]['threads']} thread(s) each; every variant "
            f"trains its own copy of {work.model} (same seed) with DDP, global batch {work.batch_per_rank * nproc}. "
            f"After {work.warmup_steps} warm-up steps per variant, {reps} rounds time one block of "
            f"{work.steps_per_repeat} steps of every variant (order rotated each round; "
            + ("CUDA events" if device == "cuda" else "host clock")
            + "); a block's time is its slowest rank's, "
            "step time = block / steps. Bytes per step: measured by a counting comm hook on rt.ddp wrapping torch's "
            "allreduce_hook / fp16_compress_hook / bf16_compress_hook, summing bucket elements x the element size "
            "all-reduced, over the timed steps (the payload per rank; a ring all-reduce moves ~2(N-1)/N times it)."
        ),
        "work": asdict(work),
        "nproc": nproc,
        "global_batch": work.batch_per_rank * nproc,
        "repeats": reps,
        "backend": ranks[0]["backend"],
        "threads_per_process": ranks[0]["threads"],
        "gradient_elements": elements,
        "gradient_mb_fp32": elements * 4 / 1e6,
        "variants": variants,
        "unavailable": unavailable,
    }


# -- report ---------------------------------------------------------------------------------------


def plot(record: dict[str, Any], path: str) -> None:
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    vs = r["variants"]
    names = [v["variant"] for v in vs] + list(r["unavailable"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    med = [v["step_ms"]["median"] for v in vs]
    err = [[m - v["step_ms"]["q1"] for m, v in zip(med, vs)], [v["step_ms"]["q3"] - m for m, v in zip(med, vs)]]
    left.bar(range(len(vs)), med, yerr=err, capsize=3, color="C0")
    left.set_ylabel("step time, ms (median, quartiles)")
    left.set_title("step time")
    right.bar(range(len(vs)), [v["mb_per_step"] for v in vs], color="C1")
    for i, v in enumerate(vs):
        right.annotate(f"{v['buckets_per_step']} bkt", (i, v["mb_per_step"]), ha="center", va="bottom", fontsize=7)
    right.set_ylabel("MB all-reduced per step per rank (measured)")
    right.set_title("bytes on the wire (label: buckets per step)")
    for ax in (left, right):
        for j in range(len(vs), len(names)):
            ax.annotate("unavailable", (j, 0), ha="center", va="bottom", rotation=90, fontsize=7, color="gray")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(len(names), 1) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    w = r["work"]
    fig.suptitle(
        f"DDP on {r['nproc']} {record.get('device', '')} processes, {w['model']} {w['image_size']}x"
        f"{w['image_size']}, {w['batch_per_rank']} per rank"
        if vs
        else r["method"],
        fontsize=10,
    )
    save_figure(fig, path, dpi=110)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (
            v["variant"],
            f"{v['step_ms']['median']:.1f} ms/step ({v['step_time_vs_default']:.2f}x), "
            f"{v['mb_per_step']:.1f} MB/step in {v['buckets_per_step']} buckets"
            + ("" if v["loss_finite"] else ", LOSS NOT FINITE"),
        )
        for v in result["variants"]
    ]
    return rows + [(name, "unavailable: " + why) for name, why in result["unavailable"].items()]
