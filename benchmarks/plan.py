"""`python -m benchmarks plan`: the plan's step time against real steps on this machine's CPU (issue 30's
goal 5: within 25% for ddp, fsdp and fsdp+tp on 1, 2 and 4 processes, on ddpkit's gpt; and
pipelines beside them, a stage per process and two pipelines beside dp, which the goal does not
name, timed stage by stage as `ddpkit plan` times them).

For each process count, this machine is calibrated first (`ddpkit.plan.calibrate`: the
processes' matrix-product and attention rates, memory bandwidth, the cost of an operation and of
one on DTensors, the collectives' alpha and beta, all measured here on a reference gpt of
another shape), and the plan's cluster is made of those figures. Then each layout of the case
below is traced as the plan traces it and predicted on that cluster, and run for real through
ddpkit's Runtime in the same number of processes: `--timed-steps` steps after two untimed ones
and two tracked for memory (`plan.verify`). The ratio is the prediction over the measured
median.

On a small shared machine one calibration and one measurement move by 20% from run to run (the
reference step once took 38 ms and then 45 ms, minutes apart), and the prediction moves with
them. So the whole of it, calibration included, runs `--repeats` times (default 3; --quick 1):
`rows` holds every round's, and `summary` each layout's ratios over the rounds, their median and
how many rounds met the goal.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from ddpkit.bench.common import stats

DESCRIPTION = (
    "the plan's predicted step time against real steps here, for ddp, fsdp, fsdp+tp and pipelines on 1, 2, 4 processes"
)
CASE = {"width": 128, "depth": 4, "heads": 4}
SEQ_LEN, PER_RANK = 128, 8  # tokens per sequence; sequences per data rank per step
PIPELINE_MICRO = 2  # a pipeline's rows per micro-batch: 4 micro-batches a step
GOAL = 0.25


def add_arguments(parser: Any) -> None:
    parser.add_argument("--processes", default="", help="process counts, comma-separated (default 1,2,4; --quick 2)")
    parser.add_argument(
        "--timed-steps", type=int, default=0, help="real steps timed per layout (default 15; --quick 2)"
    )


def cases(nproc: int) -> list[Any]:
    """gpt (CASE) under ddp, fsdp and fsdp+tp (tp 2, where the processes are even); and as a
    pipeline of a stage per process (PIPELINE_MICRO rows a micro-batch, 1f1b), and beside dp
    as two pipelines of half as many stages, where those stages are 2 to 4 (a step has 4
    micro-batches)."""
    from ddpkit.plan.run import Spec
    from ddpkit.plan.trace import Layout

    layouts = [("ddp", f"dp={nproc}", nproc, PER_RANK), ("fsdp", f"dp={nproc}", nproc, PER_RANK)]
    if nproc % 2 == 0:
        layouts.append(("tp", f"dp={nproc // 2},tp=2", nproc // 2, PER_RANK))
    most = PER_RANK // PIPELINE_MICRO  # stages: 1f1b runs a micro-batch per stage at least (the gpt has 6 children)
    if 1 < nproc <= most:
        layouts.append(("pp", f"pp={nproc}", 1, PIPELINE_MICRO))
    if nproc % 2 == 0 and 1 < nproc // 2 <= most:
        layouts.append(("pp", f"pp={nproc // 2},dp=2", 2, PIPELINE_MICRO))
    out = []
    for strategy, mesh, data, micro in layouts:
        spec = Spec("gpt", (SEQ_LEN,), 256, PER_RANK * data, "fp32", "adamw", CASE, (False,))
        out.append((spec, Layout(strategy, mesh, False, micro)))
    return out


def run(opts: Any, device: str) -> dict[str, Any]:
    from ddpkit.core import checks
    from ddpkit.plan.calibrate import measure
    from ddpkit.plan.verify import measured, predicted

    if device != "cpu":  # `bench all` on a GPU machine: the GPU presets are checked by `ddpkit plan --verify`
        return {"unavailable": "the plan's CPU time model is checked on CPU processes: --device cpu"}
    extra = opts.extra
    given = extra.get("processes") or ("2" if opts.quick else "1,2,4")
    counts = list(checks.int_list("--processes", given, "1,2,4"))
    timed = extra.get("timed_steps") or (2 if opts.quick else 15)
    rounds = opts.reps(default=3, quick=1)
    rows, calibrations = [], {}
    for round_ in range(rounds):
        for nproc in counts:
            calibration = measure(nproc)
            cluster = calibration.cluster()
            key = str(nproc) if round_ == 0 else f"{nproc} (round {round_ + 1})"
            calibrations[key] = {k: v for k, v in calibration.__dict__.items() if k != "samples"}
            calibrations[key]["samples"] = calibration.samples
            todo = cases(nproc)
            traced = predicted(todo, nproc)
            real = measured(todo, nproc, timed_steps=timed)
            rows += [_row(round_, nproc, case, t, r, cluster) for case, t, r in zip(todo, traced, real)]
    return {
        "case": {"model": "gpt", **CASE, "seq_len": SEQ_LEN, "per_rank": PER_RANK, "precision": "fp32"},
        "goal": f"predicted within {GOAL:.0%} of measured",
        "rounds": rounds,
        "rows": rows,
        "summary": _summary(rows),
        "calibrations": calibrations,
    }


def _row(round_: int, nproc: int, case: Any, t: Any, r: dict[str, Any], cluster: Any) -> dict[str, Any]:
    """One layout's prediction (its trace `t` on `cluster`) beside its real steps `r`."""
    from ddpkit.plan.predict import predict

    spec, layout = case
    if isinstance(t, list):  # a pipeline's stages, each timed on its own (as `ddpkit plan` has them)
        t = replace(max(t, key=lambda stage: stage.peak), stages=t)
    p = predict(t, layout, cluster, cluster.peak_flops("fp32"), spec.global_batch, SEQ_LEN, 1.0)
    ratio = p.step_s / r["step_s"]
    return {
        "round": round_ + 1,
        "processes": nproc,
        "layout": layout.label,
        "predicted_s": p.step_s,
        "predicted_compute_s": p.compute_s,
        "predicted_comm_s": p.exposed_comm_s,
        "measured_s": stats(r["steps_s"]),
        "threads": r["threads"],
        "ratio": ratio,
        "within_goal": abs(ratio - 1) <= GOAL,
        "work": p.trace.work.to_json() if p.trace.work is not None else None,  # (a pipeline's: its slowest stage's)
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each layout's ratios over the rounds (in order), their median, and the rounds within the goal."""
    ratios: dict[tuple[int, str], list[float]] = {}
    for row in rows:
        ratios.setdefault((row["processes"], row["layout"]), []).append(row["ratio"])
    return [
        {
            "processes": nproc,
            "layout": layout,
            "ratios": values,
            "median_ratio": statistics.median(values),
            "rounds_within_goal": sum(abs(v - 1) <= GOAL for v in values),
        }
        for (nproc, layout), values in ratios.items()
    ]


def plot(record: dict[str, Any], path: str) -> None:
    """Each layout's predicted / measured step time, one dot per round, against the goal's band;
    below, the last round's predicted and measured milliseconds."""
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    result = record["result"]
    rows, summary = result.get("rows"), result.get("summary")
    if not rows or not summary:
        return
    names = [f"{s['layout'].rsplit(' mb', 1)[0]}\n({s['processes']} proc)" for s in summary]
    x = range(len(summary))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.1 * len(summary)), 7), sharex=True)
    top.axhspan(1 - GOAL, 1 + GOAL, color="tab:green", alpha=0.12, label=f"goal: within {GOAL:.0%}")
    top.axhline(1, color="tab:green", lw=0.8)
    for i, s in zip(x, summary):
        top.scatter([i] * len(s["ratios"]), s["ratios"], color="tab:blue", s=22, zorder=3)
        top.annotate(f"{s['median_ratio']:.2f}", (i, max(s["ratios"])), ha="center", va="bottom", fontsize=8)
    top.set_ylabel("predicted / measured")
    top.set_title(
        f"ddpkit plan on this CPU: {result['rounds']} rounds, each calibrated afresh (dots: rounds; number: median)",
        fontsize=10,
    )
    top.legend(fontsize=8, loc="upper left")
    last = [r for r in rows if r["round"] == result["rounds"]]
    measured = [r["measured_s"]["median"] * 1e3 for r in last]
    err = [
        [m - r["measured_s"]["q1"] * 1e3 for m, r in zip(measured, last)],
        [r["measured_s"]["q3"] * 1e3 - m for m, r in zip(measured, last)],
    ]
    bottom.bar([i - 0.2 for i in x], [r["predicted_s"] * 1e3 for r in last], 0.4, label="predicted")
    bottom.bar([i + 0.2 for i in x], measured, 0.4, yerr=err, label="measured (median, quartiles)")
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(names, fontsize=8)
    bottom.set_ylabel("step time, ms (last round)")
    bottom.legend(fontsize=8)
    save_figure(fig, path)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    if "rows" not in result:
        return [("plan", "unavailable: " + result.get("unavailable", ""))]
    return [
        (
            f"{s['layout']} on {s['processes']}: predicted / measured",
            f"{s['median_ratio']:.2f} (rounds: {', '.join(f'{v:.2f}' for v in s['ratios'])}; "
            f"{s['rounds_within_goal']} of {len(s['ratios'])} within {GOAL:.0%})",
        )
        for s in result.get("summary", [])
    ]
