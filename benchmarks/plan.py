"""`python -m benchmarks plan`: the plan's step time against real steps on this machine's CPU (issue 30's
goal 5: within 25% for ddp, fsdp and fsdp+tp on 1, 2 and 4 processes, on ddpkit's gpt).

For each process count, this machine is calibrated first (`ddpkit.plan.calibrate`: the
processes' matrix-product and attention rates, memory bandwidth, the cost of an operation and of
one on DTensors, the collectives' alpha and beta, all measured here on a reference gpt of
another shape), and the plan's cluster is made of those figures. Then each layout of the case
below is traced as the plan traces it and predicted on that cluster, and run for real through
ddpkit's Runtime in the same number of processes: `--timed-steps` steps after two untimed ones
and two tracked for memory (`plan.verify`). The ratio is the prediction over the measured
median.
"""

from __future__ import annotations

from typing import Any

from ddpkit.bench.common import stats

DESCRIPTION = "the plan's predicted step time against real steps here, for ddp, fsdp and fsdp+tp on 1, 2, 4 processes"
CASE = {"width": 128, "depth": 4, "heads": 4}
SEQ_LEN, PER_RANK = 128, 8  # tokens per sequence; sequences per data rank per step
GOAL = 0.25


def add_arguments(parser: Any) -> None:
    parser.add_argument("--processes", default="", help="process counts, comma-separated (default 1,2,4; --quick 2)")
    parser.add_argument(
        "--timed-steps", type=int, default=0, help="real steps timed per layout (default 15; --quick 2)"
    )


def cases(nproc: int) -> list[Any]:
    """gpt (CASE) under ddp, fsdp and fsdp+tp (tp 2, where the processes are even)."""
    from ddpkit.plan.run import Spec
    from ddpkit.plan.trace import Layout

    layouts = [("ddp", f"dp={nproc}", nproc), ("fsdp", f"dp={nproc}", nproc)]
    if nproc % 2 == 0:
        layouts.append(("tp", f"dp={nproc // 2},tp=2", nproc // 2))
    out = []
    for strategy, mesh, data in layouts:
        spec = Spec("gpt", (SEQ_LEN,), 256, PER_RANK * data, "fp32", "adamw", CASE, (False,))
        out.append((spec, Layout(strategy, mesh, False, PER_RANK)))
    return out


def run(opts: Any, device: str) -> dict[str, Any]:
    from ddpkit.core import checks
    from ddpkit.plan.calibrate import measure
    from ddpkit.plan.predict import predict
    from ddpkit.plan.verify import measured, predicted

    if device != "cpu":  # `bench all` on a GPU machine: the GPU presets are checked by `ddpkit plan --verify`
        return {"unavailable": "the plan's CPU time model is checked on CPU processes: --device cpu"}
    extra = opts.extra
    given = extra.get("processes") or ("2" if opts.quick else "1,2,4")
    counts = list(checks.int_list("--processes", given, "1,2,4"))
    timed = extra.get("timed_steps") or (2 if opts.quick else 15)
    rows, calibrations = [], {}
    for nproc in counts:
        calibration = measure(nproc)
        cluster = calibration.cluster()
        calibrations[str(nproc)] = {k: v for k, v in calibration.__dict__.items() if k != "samples"}
        calibrations[str(nproc)]["samples"] = calibration.samples
        todo = cases(nproc)
        traced = predicted(todo, nproc)
        real = measured(todo, nproc, timed_steps=timed)
        for (spec, layout), t, r in zip(todo, traced, real):
            p = predict(t, layout, cluster, cluster.peak_flops("fp32"), spec.global_batch, SEQ_LEN, 1.0)
            ratio = p.step_s / r["step_s"]
            rows.append(
                {
                    "processes": nproc,
                    "layout": layout.label,
                    "predicted_s": p.step_s,
                    "predicted_compute_s": p.compute_s,
                    "predicted_comm_s": p.exposed_comm_s,
                    "measured_s": stats(r["steps_s"]),
                    "ratio": ratio,
                    "within_goal": abs(ratio - 1) <= GOAL,
                    "work": t.work.to_json() if t.work is not None else None,
                }
            )
    return {
        "case": {"model": "gpt", **CASE, "seq_len": SEQ_LEN, "per_rank": PER_RANK, "precision": "fp32"},
        "goal": f"predicted within {GOAL:.0%} of measured",
        "rows": rows,
        "calibrations": calibrations,
    }


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    rows = record["result"].get("rows")
    if not rows:
        return
    names = [f"{r['layout'].rsplit(' mb', 1)[0]}\n({r['processes']} proc)" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5))
    measured = [r["measured_s"]["median"] * 1e3 for r in rows]
    err = [
        [m - r["measured_s"]["q1"] * 1e3 for m, r in zip(measured, rows)],
        [r["measured_s"]["q3"] * 1e3 - m for m, r in zip(measured, rows)],
    ]
    ax.bar([i - 0.2 for i in x], [r["predicted_s"] * 1e3 for r in rows], 0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], measured, 0.4, yerr=err, label="measured (median, quartiles)")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['ratio']:.2f}", (i, max(r["predicted_s"] * 1e3, measured[i])), ha="center", va="bottom")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("step time, ms")
    ax.set_title("ddpkit plan on this CPU: predicted / measured step time", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    if "rows" not in result:
        return [("plan", "unavailable: " + result.get("unavailable", ""))]
    return [
        (f"{r['layout']} on {r['processes']}: predicted / measured", f"{r['ratio']:.2f}")
        for r in result.get("rows", [])
    ]
