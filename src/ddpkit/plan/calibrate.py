"""A cluster of this machine's CPU: its figures measured here, for `ddpkit plan --gpu cpu` and
for checking the plan's step times against real runs (`python -m benchmarks plan`, from the repository).

`nproc` processes start as `ddpkit train` would start them (gloo, and ddpkit's share of the
cores each: `ddpkit.core.threads`) and measure, all at once so that they contend for the cores
as a job's processes do:

- the matrix-product rate (FLOP/s) of one process, in fp32 and bf16, on square products of
  `PRODUCT` rows;
- the rate of its fused attention kernel, forward and backward (causal, 4 heads of 32 over
  128 positions), by torch's FLOP formulas: on a CPU a tenth of the products' rate;
- the memory bandwidth of one process (bytes read and written per second, copying a 64 MiB
  tensor);
- what one operation costs beyond its work: a chain of small operations through autograd,
  forward and backward, over the operations it dispatched;
- how much of those rates a training step reaches with every process busy (`efficiency`): a
  reference gpt (`REFERENCE`, of another shape than any case checked against it) run for real
  under ddp through ddpkit's Runtime on all the processes, against the time the rates above give
  its operations (its gradients' all-reduce taken out by the ring model). Processes on shared
  cores slow each other beyond what each figure alone shows (30% for two on this 2-core
  machine), and DDP and gloo's threads take from the compute too;
- what an operation on DTensors costs more (DTensor's dispatch and FSDP2's hooks, in Python),
  where there are several processes: the reference gpt run for real under fsdp and under
  fsdp+tp (tp 2), against the plan's prediction of it without that cost, the difference over
  the operations on DTensors it counted, for each kind of layout.
- each collective kind over all processes at sizes from 1 KiB to 4 MiB, fitted to the plan's
  ring model (`predict.RING`) by least squares on relative errors: a latency per ring step
  (alpha) and a bandwidth (1/beta).

Each figure is rank 0's median over repeated timings. The processes' collectives do not overlap
their compute here (gloo's threads share the same cores), so the cluster says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .cluster import Cluster, Gpu

# Imports inside functions: torch and the launcher load when a calibration runs.

PRODUCT = 512  # rows of the square products timed
# The reference step: gpt at this shape, on batches of 8 sequences
REFERENCE = {"width": 192, "depth": 2, "heads": 4, "context": 96}
REFERENCE_STEPS = 9  # timed steps of each reference run
COPY_BYTES = 64 * 2**20
SIZES = (2**10, 2**14, 2**18, 2**22)  # bytes each rank hands a collective
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Calibration:
    """What `measure` found, per process: FLOP/s by precision, bytes/s, seconds per operation,
    and the collectives' alpha (s per ring step) and bandwidth (bytes/s)."""

    nproc: int
    flops_per_s: dict[str, float]
    bytes_per_s: float
    per_op_s: float
    per_dtensor_op_s: dict[str, float]  # by the layout's kind: "fsdp", "tp"
    attention_flops_per_s: float
    efficiency: float
    alpha_s: float
    link_bytes_per_s: float
    memory_gib: float
    samples: dict[str, Any]  # the timings the figures came from

    def cluster(self) -> Cluster:
        """A one-node cluster of `nproc` CPU processes with these figures."""
        gpu = Gpu(
            name=f"CPU process (of {self.nproc} here, measured)",
            memory_gib=self.memory_gib,
            peak_tflops={
                "fp32": self.flops_per_s["fp32"] / 1e12,
                "tf32": self.flops_per_s["fp32"] / 1e12,
                "bf16": self.flops_per_s["bf16"] / 1e12,
                "fp16": self.flops_per_s["bf16"] / 1e12,
            },
            intra_gbps=self.link_bytes_per_s / 1e9,
            inter_gbps=self.link_bytes_per_s / 1e9,
            intra_latency_us=self.alpha_s * 1e6,
            inter_latency_us=self.alpha_s * 1e6,
            memory_gbps=self.bytes_per_s / 1e9,
            op_overhead_us=self.per_op_s * 1e6,
            dtensor_op_overhead_us={k: v * 1e6 for k, v in self.per_dtensor_op_s.items()},
            attention_tflops=self.attention_flops_per_s / 1e12,
            overlap=False,
            device="cpu",
        )
        return Cluster(gpu, self.nproc, 1, efficiency=self.efficiency)


def measure(nproc: int) -> Calibration:
    """Measure this machine's figures with `nproc` gloo processes (see the module docstring)."""
    from ..core.memory import available_mib
    from ..launcher import launch

    ranks = launch(_worker, nproc, nproc=nproc, device="cpu")
    found = ranks[0]
    alpha, link = _fit(found["collectives"], nproc)
    memory = (available_mib() or 0.0) / 1024 / nproc
    calibration = Calibration(
        nproc,
        found["flops_per_s"],
        found["bytes_per_s"],
        found["per_op_s"],
        {},
        found["attention_flops_per_s"],
        1.0,
        alpha,
        link,
        memory,
        {"collectives": found["collectives"], "threads": found["threads"]},
    )
    return _fitted(calibration)


def reference_cases(nproc: int) -> list[Any]:
    """The reference gpt under ddp, fsdp and fsdp+tp (tp 2, where `nproc` is even) on `nproc`
    processes, 8 sequences per data rank."""
    from .run import Spec
    from .trace import Layout

    shape = dict(REFERENCE)
    context = shape.pop("context")
    cases = []
    for strategy, mesh, data in (
        ("ddp", f"dp={nproc}", nproc),
        ("fsdp", f"dp={nproc}", nproc),
        ("tp", f"dp={nproc // 2},tp=2", nproc // 2),
    ):
        if strategy == "tp" and nproc % 2:
            continue
        spec = Spec("gpt", (context,), 256, 8 * data, "fp32", "adamw", shape, (False,))
        cases.append((spec, Layout(strategy, mesh, False, 8)))
    return cases


def _fitted(calibration: Calibration) -> Calibration:
    """`calibration` with its efficiency from the reference gpt under ddp run for real here, and
    its cost per operation on DTensors by kind of layout from the same under fsdp and fsdp+tp."""
    from .predict import predict
    from .verify import measured, predicted

    nproc = calibration.nproc
    cases = reference_cases(nproc)
    traced = predicted(cases, nproc)
    real = measured(cases, nproc, timed_steps=REFERENCE_STEPS)
    plain = replace(calibration, efficiency=1.0).cluster()

    def parts(i: int) -> tuple[float, float, float]:
        """The reference case's compute at efficiency 1 and no DTensor cost, its exposed
        collectives' time, and its measured median."""
        (spec, layout), t = cases[i], traced[i]
        p = predict(t, layout, plain, plain.peak_flops("fp32"), spec.global_batch, None, 1.0)
        return p.compute_s, p.exposed_comm_s, real[i]["step_s"]

    found = [parts(i) for i in range(len(cases))]
    busy, comm, seconds = found[0]  # ddp
    efficiency = min(1.0, max(0.001, busy / max(seconds - comm, 1e-9)))
    overhead = {}
    for i in range(1, len(cases)):
        busy, comm, seconds = found[i]
        layout, work = cases[i][1], traced[i].work
        assert work is not None
        kind = "tp" if layout.spec.size("tp") > 1 else "fsdp"
        # seconds = (busy + calls x overhead) / efficiency + comm
        overhead[kind] = max(0.0, ((seconds - comm) * efficiency - busy) / max(1, work.distributed_calls))
    runs = [
        {"layout": case[1].label, "measured_s": seconds, "compute_s": busy, "comm_s": comm, "threads": r["threads"]}
        for case, (busy, comm, seconds), r in zip(cases, found, real)
    ]
    samples = {**calibration.samples, "reference_runs": runs}
    return replace(calibration, efficiency=efficiency, per_dtensor_op_s=overhead, samples=samples)


def _fit(timings: list[dict[str, Any]], n: int) -> tuple[float, float]:
    """alpha (s per ring step) and bandwidth (bytes/s) of `predict.RING` fitted to the timings
    by least squares on relative errors (one process: no collective, none).

    Relative, as the timings span three orders of magnitude (1 KiB to 4 MiB): fitted on seconds,
    the largest messages set the latency too, and their noise made it negative in one whole run
    of the test suite, a latency of nothing. Where noise still beats the model, the latency is
    the smallest messages' time (nearly all latency) and the bandwidth is fitted to the rest."""
    import torch

    from .predict import RING

    if n == 1 or not timings:
        return 0.0, 1e12
    rows = [(RING[t["kind"]][0](n), RING[t["kind"]][1](n) * t["bytes"]) for t in timings]
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor([t["seconds"] for t in timings], dtype=torch.float64)
    weight = 1.0 / b.clamp_min(1e-12)
    a, b = a * weight[:, None], b * weight  # each timing's error relative to it
    alpha, inverse = torch.linalg.lstsq(a, b[:, None]).solution.flatten().tolist()
    if inverse <= 0 or alpha <= 0:
        smallest = min(t["bytes"] for t in timings)
        alpha = statistics.median(
            t["seconds"] / steps for t, (steps, _) in zip(timings, rows) if t["bytes"] == smallest
        )
        rest = b - a[:, 0] * alpha
        inverse = float(rest @ a[:, 1] / (a[:, 1] @ a[:, 1]))
    return alpha, 1.0 / max(inverse, 1e-15)


def _timed(fn: Callable[[], Any], seconds: float = 0.25, blocks: int = 5, calls: int | None = None) -> float:
    """The median seconds of one call of `fn`, over `blocks` blocks of calls lasting about
    `seconds` together, or of `calls` calls each (a collective: every rank must make as many)."""
    fn()
    start = time.perf_counter()
    if calls is None:
        calls = 0
        while time.perf_counter() - start < seconds / blocks or calls < 1:
            fn()
            calls += 1
    per_block = max(1, calls)
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(per_block):
            fn()
        times.append((time.perf_counter() - t0) / per_block)
    return statistics.median(times)


def _worker(nproc: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..core.dist import gather_into, reduce_scatter_into
    from ..runtime import Runtime
    from .work import Counting

    with Runtime(device="cpu") as rt:
        flops = {}
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = (torch.randn(PRODUCT, PRODUCT).to(dtype) for _ in range(2))
            rt.barrier()
            flops[precision] = 2 * PRODUCT**3 / _timed(lambda a=a, b=b: a @ b)
        source = torch.empty(COPY_BYTES // 4)
        target = torch.empty_like(source)
        rt.barrier()
        bandwidth = 2 * COPY_BYTES / _timed(lambda: target.copy_(source))
        x = torch.ones(16, requires_grad=True)

        def chain() -> None:
            y = x
            for _ in range(50):
                y = y * 1.0001
            y.sum().backward()

        with Counting() as counted:
            chain()
        rt.barrier()
        per_op = _timed(chain) / counted.ops.calls
        attention = _attention_rate(rt)
        collectives = []
        for kind in KINDS if nproc > 1 else ():
            for numel in collective_numels(nproc):
                sent = torch.ones(numel)
                out = torch.empty(numel * nproc) if kind == "all_gather" else torch.empty(numel // nproc)
                call = {
                    "all_reduce": lambda sent=sent: dist.all_reduce(sent),
                    "all_gather": lambda sent=sent, out=out: gather_into(out, sent),
                    "reduce_scatter": lambda sent=sent, out=out: reduce_scatter_into(out, sent),
                }[kind]
                rt.barrier()
                reps = max(2, 2**14 // numel)  # as many on every rank
                seconds = _timed(call, blocks=3, calls=reps)
                collectives.append({"kind": kind, "bytes": 4 * numel, "seconds": seconds})
        rt.barrier()
        return {
            "flops_per_s": flops,
            "bytes_per_s": bandwidth,
            "per_op_s": per_op,
            "attention_flops_per_s": attention,
            "collectives": collectives,
            "threads": torch.get_num_threads(),  # each process's, as ddpkit.core.threads chose it
        }


def collective_numels(nproc: int) -> list[int]:
    """The float32 elements each rank hands a timed collective: about SIZES bytes, each a
    multiple of `nproc` (a reduce-scatter splits its input into `nproc` equal parts)."""
    return [max(1, size // 4 // nproc) * nproc for size in SIZES]


def _attention_rate(rt: Any) -> float:
    """FLOP/s of torch's attention, forward and backward, as its FLOP formulas count them."""
    import torch
    import torch.nn.functional as F

    from .work import Counting

    q, k, v = (torch.randn(8, 4, 128, 32, requires_grad=True) for _ in range(3))

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with Counting() as counted:
        attention()
    flops = sum(op.flops * n for op, n in counted.ops.counts.items() if op.attention)
    rt.barrier()
    return flops / _timed(attention)
