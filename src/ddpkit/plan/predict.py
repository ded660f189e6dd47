"""From a traced step to a prediction: which layouts to try on a cluster, the step time of each
by an alpha-beta model of its collectives, and which fits and runs fastest.

Time, stated in every plan:
- compute: the traced FLOPs of a rank's step over the GPU's peak at the plan's efficiency;
- a collective over a group of n ranks moving b bytes (what this rank hands to it) takes
  alpha * steps + bytes on the wire / bandwidth, as a ring does: all-reduce 2(n-1) steps and
  2(n-1)/n b on the wire, all-gather (n-1) and (n-1) b, reduce-scatter (n-1) and (n-1)/n b,
  broadcast and send 1 and b. A group within one node uses NVLink's figures, a group across
  nodes the network's (its slowest link);
- overlap: the data-parallel collectives run beside the compute and cost only what exceeds it:
  DDP's all-reduce beside the backward (2/3 of the compute), FSDP2's all-gathers and
  reduce-scatters beside all of it; tensor-parallel collectives sit between a layer's
  products and cost in full;
- a pipeline (pp=P, 1f1b or gpipe over m micro-batches): each stage timed on its own, and the step is
  the slowest stage's time. A stage's: its compute (its children's FLOPs, as the split cuts
  them; on a processor measured here, its traced operations, as a step's) times
  (m + P - 1) / m, the bubble while the pipeline fills and drains, plus its sends
  (activations forward, gradients back; a send within a node at NVLink's figures only where
  the whole pipeline is) and tp's collectives (pp=P,tp=T) in full. With dp beside it
  (pp=P,dp=D), the stage's DDP all-reduce runs in its last micro-batch's backward (2/3 of that
  micro-batch's compute), and costs what exceeds it; in 3-D (pp=P,dp=D,tp=T), FSDP2's
  all-gathers and reduce-scatters over dp are taken to run in the same window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..observe.collectives import Op
from .cluster import GIB, Cluster
from .trace import Layout, Trace

# Imports inside functions: the mesh's parser, from the strategies (torch), loads when layouts
# are listed.

# Steps of a ring and the bytes on the wire, as multiples of the payload, for a group of n.
RING: dict[str, Any] = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: n - 1),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: 1, lambda n: 1),
    "send": (lambda n: 1, lambda n: 1),
}
DATA_PARALLEL = ("dp", "replicate")
BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward, beside which DDP's all-reduce runs


STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "pp")  # the layouts' strategies, as `ddpkit train --strategy` names them


def layouts(
    cluster: Cluster,
    share_of: Any,
    heads: int | None,
    checkpointing: tuple[bool | str, ...],
    stages: int = 0,
) -> list[Layout]:
    """Every layout ddpkit can run on `cluster` (ddp, fsdp, hsdp with one replica per node,
    fsdp+tp with tp within a node, pipelines of P stages for every P that divides the GPUs, one
    per data rank, each stage under DDP over them, and pipelines whose stages split their layers
    over tp within a node, one per data rank, each stage sharded over them by FSDP2 where there
    are several: 3-D), each with and without activation
    checkpointing; the micro-batch is chosen later. `share_of(data_ranks)` is a data rank's
    samples, None where the global batch does not divide; `heads` limits tp to divisors (None:
    no tp plan); `stages` is the most stages the model splits into (0: no pipeline)."""
    world, per_node = cluster.world_size, cluster.gpus_per_node
    meshes = [("ddp", f"dp={world}"), ("fsdp", f"dp={world}")]
    if cluster.nodes > 1 and per_node > 1:
        meshes.append(("hsdp", f"replicate={cluster.nodes},dp={per_node}"))
    tp = 2
    while heads and tp <= per_node:
        if per_node % tp == 0 and heads % tp == 0 and share_of(world // tp):
            meshes.append(("tp", f"dp={world // tp},tp={tp}"))
        tp *= 2
    for pp in range(2, min(world, stages) + 1):  # pipelines of pp stages, one per data rank
        data = world // pp
        if world % pp == 0:
            meshes.append(("pp", f"pp={pp}" if data == 1 else f"pp={pp},dp={data}"))
        tp = 2  # pipelines whose stages split their layers over tp within a node: pp x tp, and 3-D
        while heads and pp * tp <= world and tp <= per_node:
            data = world // (pp * tp)
            if world % (pp * tp) == 0 and per_node % tp == 0 and heads % tp == 0:
                meshes.append(("pp", f"pp={pp},tp={tp}" if data == 1 else f"pp={pp},dp={data},tp={tp}"))
            tp *= 2
    return [
        Layout(strategy, mesh, ac, 0, _schedule(mesh, share_of))
        for strategy, mesh in meshes
        if share_of(_data(mesh))
        for ac in checkpointing
    ]


def _schedule(mesh: str, share_of: Any) -> str:
    """A pipeline's schedule: 1f1b (ddpkit's default), where each stage has a micro-batch at
    least; else gpipe, which runs fewer micro-batches than stages (more activations held, the
    same bubble). Not a pipeline: 1f1b, unused."""
    from ..strategy.mesh import MeshSpec

    spec = MeshSpec.parse(mesh)
    return "gpipe" if (share_of(spec.data_size) or 0) < spec.size("pp") else "1f1b"


def _data(mesh: str) -> int:
    from ..strategy.mesh import MeshSpec

    return MeshSpec.parse(mesh).data_size


def op_seconds(op: Op, cluster: Cluster) -> float:
    """One collective's time on `cluster` by the ring model (see the module docstring): one call
    of `op`'s (it may stand for `op.calls`)."""
    n = len(op.ranks) or 1
    if n == 1:
        return 0.0
    steps, wire = RING[op.kind]
    across = len({cluster.node_of(r) for r in op.ranks}) > 1
    gpu = cluster.gpu
    bandwidth = (gpu.inter_gbps if across else gpu.intra_gbps) * 1e9
    latency = (gpu.inter_latency_us if across else gpu.intra_latency_us) * 1e-6
    return steps(n) * latency + wire(n) * op.bytes / bandwidth


@dataclass
class Prediction:
    """A layout's predicted per-rank memory and step time, and whether it fits."""

    layout: Layout
    trace: Trace
    compute_s: float
    overlapped_comm_s: float
    exposed_comm_s: float
    step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    fits: bool

    def to_json(self, cluster: Cluster) -> dict[str, Any]:
        return {
            "layout": self.layout.label,
            "strategy": self.layout.strategy,
            "mesh": self.layout.mesh,
            "activation_checkpointing": self.layout.checkpointing_mode or False,
            "micro_batch": self.layout.micro_batch,
            "schedule": self.layout.schedule if self.layout.strategy == "pp" else None,
            "memory_gib": {k: v / GIB for k, v in self.trace.memory.items()},
            "peak_gib": self.trace.peak / GIB,
            "fits": self.fits,
            "compute_s": self.compute_s,
            "data_parallel_comm_s": self.overlapped_comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / cluster.world_size if self.tokens_per_s else None,
            "mfu": self.mfu,
            "flops_per_rank": self.trace.flops,
            "collectives": _by_kind(self.trace.ops, cluster),
            "computed": self.trace.computed,
        }


def predict(
    trace: Trace,
    layout: Layout,
    cluster: Cluster,
    peak: float,
    global_batch: int,
    seq_len: int | None,
    model_flops: float,
) -> Prediction:
    """The step time and throughput of `layout` from its `trace` at `peak` FLOP/s per GPU;
    `model_flops` is the step's useful FLOPs over the whole job (no recomputation), for MFU."""
    if layout.strategy == "pp":  # each stage timed on its own; the slowest's is the step's
        timed = [_stage_seconds(stage, layout, cluster, peak, global_batch) for stage in trace.stages or [trace]]
        slowest = max(range(len(timed)), key=lambda s: timed[s][0] + timed[s][2])
        compute, dp_comm, exposed = timed[slowest]
        if trace.stages:  # its FLOPs and collectives are the ones reported
            stage = trace.stages[slowest]
            trace = replace(trace, ops=stage.ops, flops=stage.flops, work=stage.work)
    else:
        compute = _compute_seconds(trace, layout, cluster, peak)
        dp_comm, exposed = _data_and_exposed(trace, layout, cluster, compute)
    step = compute + exposed
    tokens = global_batch * seq_len / step if seq_len else None
    mfu = model_flops / (step * cluster.world_size * peak)
    fits = trace.peak <= cluster.gpu.memory_gib * GIB
    return Prediction(layout, trace, compute, dp_comm, exposed, step, global_batch / step, tokens, mfu, fits)


def _compute_seconds(trace: Trace, layout: Layout, cluster: Cluster, peak: float) -> float:
    """The seconds of a traced step's (or pipeline stage's) compute: on a processor measured
    here, its every operation (`work`); else its FLOPs at `peak` FLOP/s; at the cluster's
    efficiency."""
    gpu = cluster.gpu
    if trace.work is not None and gpu.memory_gbps:  # a processor measured here: see `work`
        busy = trace.work.seconds(
            peak,
            gpu.memory_gbps * 1e9,
            gpu.op_overhead_us * 1e-6,
            gpu.dtensor_op_overhead_us.get("tp" if layout.spec.size("tp") > 1 else "fsdp", 0.0) * 1e-6,
            gpu.attention_tflops * 1e12 or None,
        )
        return busy / cluster.efficiency
    return trace.flops / (peak * cluster.efficiency)


def _stage_seconds(
    stage: Trace, layout: Layout, cluster: Cluster, peak: float, global_batch: int
) -> tuple[float, float, float]:
    """A pipeline stage's compute (with the bubble), data-parallel collectives and exposed
    collectives, in seconds, from its compute (`_compute_seconds`: its FLOPs, or on a processor
    measured here its operations) and its collectives (see the module docstring)."""
    stages = layout.spec.size("pp")
    chunks = -(-global_batch // layout.spec.data_size // layout.micro_batch)
    compute = _compute_seconds(stage, layout, cluster, peak)
    # the sends between stages and tp's collectives in full; the stage's DDP all-reduce (pp x
    # dp) beside its last micro-batch's backward, where torch's stage lets DDP reduce
    sends = dp_comm = 0.0
    for op in stage.ops:
        seconds = op_seconds(op, cluster) * op.calls
        if op.kind == "send" or _is_tp(op, layout):
            sends += seconds
        else:
            dp_comm += seconds
    window = compute / chunks * BACKWARD_SHARE if cluster.gpu.overlap else 0.0
    # the bubble (1f1b's and gpipe's): each stage idles while the first micro-batch fills the
    # pipeline and the last drains it, (stages - 1) micro-batches' time
    return compute * (chunks + stages - 1) / chunks, dp_comm, sends + max(0.0, dp_comm - window)


def _data_and_exposed(trace: Trace, layout: Layout, cluster: Cluster, compute: float) -> tuple[float, float]:
    """The seconds of a step's data-parallel collectives, and of the collectives the compute
    does not hide (see the module docstring's overlap)."""
    dims = layout.spec.names
    dp_comm = tp_comm = 0.0
    for op in trace.ops:
        seconds = op_seconds(op, cluster) * op.calls
        if "tp" in dims and _is_tp(op, layout):
            tp_comm += seconds
        else:
            dp_comm += seconds
    # DDP's all-reduce can only start in the backward (about 2/3 of the compute); FSDP2's
    # all-gathers run ahead of the forward and the backward, its reduce-scatters in the backward
    window = compute * (
        BACKWARD_SHARE if any(op.kind == "all_reduce" for op in trace.ops if not _is_tp(op, layout)) else 1
    )
    if not cluster.gpu.overlap:
        window = 0.0
    return dp_comm, tp_comm + max(0.0, dp_comm - window)


def _is_tp(op: Op, layout: Layout) -> bool:
    """Whether `op` runs within a tensor-parallel group: its ranks are consecutive in the tp
    dimension (the last of the mesh), as torch's DeviceMesh lays it out."""
    tp = layout.spec.size("tp")
    return len(op.ranks) == tp and op.ranks[-1] - op.ranks[0] == tp - 1


def _by_kind(ops: list[Op], cluster: Cluster) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for op in ops:
        row = out.setdefault(op.kind, {"calls": 0, "bytes": 0, "seconds": 0.0})
        row["calls"] += op.calls
        row["bytes"] += op.bytes * op.calls
        row["seconds"] += op_seconds(op, cluster) * op.calls
    return out


def best(predictions: list[Prediction]) -> Prediction | None:
    """The fastest layout that fits, None if none does; on a tie, the one that recomputes less
    (no activation checkpointing, then selective, then full: no recomputation for nothing), then
    the less memory."""
    fitting = [p for p in predictions if p.fits]
    recomputes = {None: 0, "selective": 1, "full": 2}
    return (
        min(fitting, key=lambda p: (p.step_s, recomputes[p.layout.checkpointing_mode], p.trace.peak))
        if fitting
        else None
    )
