"""A plan on the terminal (one row per layout, the assumptions, the recommended command), as
JSON, and as a plot of each layout's memory by role beside its predicted throughput."""

from __future__ import annotations

from typing import Any

from ..core.files import write_json
from ..observe.env import metadata
from ..observe.plots import pyplot, save_figure
from .cluster import GIB
from .predict import RING
from .run import Plan
from .trace import CATEGORIES

BYTES = 256  # the vocabulary of ddpkit train's --data text


def assumptions(p: Plan) -> list[str]:
    """Every assumption the figures rest on, as the plan states it."""
    c, g = p.cluster, p.cluster.gpu
    return [
        f"{c.nodes} node(s) x {c.gpus_per_node} {g.name} ({g.memory_gib:g} GiB; "
        f"{c.peak_flops(p.spec.precision, not p.spec.language) / 1e12:g} TFLOP/s dense {p.spec.precision} peak"
        + (", TF32 for convolutions" if p.spec.precision == "fp32" and not p.spec.language else "")
        + ")",
        _compute(p),
        f"links, one direction per GPU: {g.intra_gbps:g} GB/s within a node ({g.intra_latency_us:g} us), "
        f"{g.inter_gbps:g} GB/s between nodes ({g.inter_latency_us:g} us); ring collectives",
        (
            "overlap: data-parallel collectives run beside the compute (only their excess counts); "
            "tensor-parallel ones in full; the optimizer step's time is not counted"
            if g.overlap
            else "overlap: none (every collective in full); the optimizer step counted as the trace ran it"
        ),
        "memory: tensors one rank holds at its peak, traced on fake tensors (no allocator "
        "fragmentation, no CUDA context or NCCL workspace: keep a few GiB free)",
    ]


def _compute(p: Plan) -> str:
    c, g = p.cluster, p.cluster.gpu
    if not g.memory_gbps:
        return f"compute: traced FLOPs at {c.efficiency:.0%} of the peak (--efficiency)"
    extra = ", ".join(f"{k} {v:.0f}" for k, v in g.dtensor_op_overhead_us.items())
    return (
        f"compute (measured here): each traced operation at the longer of its FLOPs at the peak "
        f"(attention at {g.attention_tflops * 1e3:.1f} GFLOP/s) and its bytes at {g.memory_gbps:.1f} GB/s, "
        f"plus {g.op_overhead_us:.1f} us each" + (f" (on DTensors more, us: {extra})" if extra else "") + f", "
        f"over {c.efficiency:.0%} (the processes' share of the cores)"
    )


def table(p: Plan) -> str:
    rate = "tokens/s/GPU" if p.spec.language else "samples/s/GPU"  # a classifier's rate is in samples
    rows = [("layout", "peak GiB", "fits", "params", "grads", "optim", "activ", "comm", "step ms", rate, "MFU")]
    for q in p.predictions:
        m = q.trace.memory
        per_gpu = (q.tokens_per_s or q.samples_per_s) / p.cluster.world_size
        rows.append(
            (
                q.layout.label,
                f"{q.trace.peak / GIB:.2f}",
                "yes" if q.fits else "NO",
                *(
                    f"{m[k] / GIB:.2f}"
                    for k in ("parameters", "gradients", "optimizer", "activations", "communication")
                ),
                f"{q.step_s * 1e3:.1f}",
                _figure(per_gpu),
                f"{q.mfu:.1%}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def _figure(x: float, decimals: int = 0) -> str:
    """`x` with `decimals` decimals, or three significant digits where those would show 0: a
    rate of 0.2 samples/s printed as 0, and 'needs 0.0 GiB per GPU of 1e-06' read as fitting."""
    return f"{x:,.{decimals}f}" if x == 0 or abs(x) >= 10**-decimals * 10 else f"{x:.3g}"


def report(p: Plan) -> str:
    """The whole plan as printed: what was planned, the table, the assumptions, the verdict."""
    s = p.spec
    lines = [
        f"ddpkit plan: {s.model} ({p.parameters / 1e6:,.1f}M parameters), global batch {s.global_batch}, "
        f"{s.precision}, {s.optimizer}, on {p.cluster.world_size} GPUs ({p.seconds:.1f} s to plan)",
        "",
        table(p),
        "",
        *(f"  assumed: {a}" for a in assumptions(p)),
        "",
    ]
    chosen = p.best
    if chosen is None:
        smallest = min(p.predictions, key=lambda q: q.trace.peak)
        lines.append(
            f"no layout fits: the smallest, {smallest.layout.label}, needs {_figure(smallest.trace.peak / GIB, 1)} "
            f"GiB per GPU of {p.cluster.gpu.memory_gib:g}; use more GPUs, a smaller model or a smaller batch"
        )
    else:
        lines += [f"fastest that fits: {chosen.layout.label}", f"  {p.command(chosen)}"]
        if s.language and s.num_classes != BYTES:
            lines.append(
                f"  (planned with a vocabulary of {s.num_classes:,} tokens; ddpkit train's --data text is bytes, "
                f"{BYTES} tokens: train that vocabulary in a loop of your own under ddpkit run, with this layout)"
            )
    return "\n".join(lines)


def to_json(p: Plan) -> dict[str, Any]:
    chosen = p.best
    return {
        "spec": {
            "model": p.spec.model,
            "in_shape": list(p.spec.in_shape),
            "num_classes": p.spec.num_classes,
            "options": p.spec.options,
            "global_batch": p.spec.global_batch,
            "precision": p.spec.precision,
            "optimizer": p.spec.optimizer,
            "parameters": p.parameters,
        },
        "cluster": p.cluster.to_json(),
        "assumptions": assumptions(p),
        "collective_model": sorted(RING),
        "layouts": [q.to_json(p.cluster) for q in p.predictions],
        "recommended": None if chosen is None else {"layout": chosen.layout.label, "command": p.command(chosen)},
        "plan_seconds": p.seconds,
        "planned_on": metadata("cpu"),
    }


def write(p: Plan, path: str) -> None:
    write_json(path, to_json(p))


def plot(p: Plan, path: str) -> None:
    """Per layout: its peak memory by role (stacked bars, the GPU's memory a line) and its
    predicted throughput beside it."""
    plt = pyplot()
    names = [q.layout.label for q in p.predictions]
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(names) + 4), 4.8))
    bottom = [0.0] * len(names)
    for role in CATEGORIES:
        values = [q.trace.memory[role] / GIB for q in p.predictions]
        mem.bar(names, values, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.axhline(p.cluster.gpu.memory_gib, color="black", linestyle="--", label=f"{p.cluster.gpu.name}")
    mem.set_ylabel("GiB per GPU at the peak")
    mem.set_title("memory (predicted)")
    mem.legend(fontsize=7)
    rate = [(q.tokens_per_s or q.samples_per_s) / p.cluster.world_size for q in p.predictions]
    colors = ["tab:green" if q.fits else "tab:gray" for q in p.predictions]
    speed.bar(names, rate, color=colors)
    speed.set_ylabel(("tokens" if p.spec.language else "samples") + "/s per GPU (gray: does not fit)")
    speed.set_title("throughput (predicted)")
    for ax in (mem, speed):
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    save_figure(fig, path)


def verification(case: Any, nproc: int, device: str, guessed: Any, real: dict[str, Any]) -> str:
    """Predicted beside measured, role by role, for one layout run here."""
    spec, layout = case
    rows = [("", "predicted MiB", "measured MiB")]
    for role in CATEGORIES:
        rows.append((role, f"{guessed.memory[role] / 2**20:.2f}", f"{real['memory'][role] / 2**20:.2f}"))
    rows.append(("peak", f"{guessed.peak / 2**20:.2f}", f"{real['peak'] / 2**20:.2f}"))
    width = max(len(r[0]) for r in rows)
    lines = [
        f"verified here: {layout.label} of {spec.model}, global batch {spec.global_batch}, on {nproc} {device} "
        f"process(es) ({'the stage that holds most, on its rank' if layout.strategy == 'pp' else 'rank 0'}; "
        "the role of each tensor at the peak moment of each side)",
        *("  " + r[0].ljust(width) + "  " + r[1].rjust(14) + "  " + r[2].rjust(13) for r in rows),
        f"  peak: predicted / measured = {guessed.peak / real['peak']:.3f}; a measured step took "
        f"{real['step_s'] * 1e3:.1f} ms here (the plan's step times are for the cluster, not this machine)",
    ]
    return "\n".join(lines)
