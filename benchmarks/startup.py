"""`python -m benchmarks startup`: the wall time of a whole small job, launch and imports included.

On a small job most of the time of a multi-process run is not training: every worker starts
an interpreter, imports torch (and the framework), joins a rendezvous, and at the end tears it
all down. This benchmark times, from outside, the whole command of the same job under each
contender:

  ddpkit      `python -m ddpkit train --nproc 2 --device cpu --epochs 10 --out DIR`
  torchrun    the PyTorch tutorial's hand-written DDP script under `torch.distributed.run`
  accelerate  the same loop under `accelerate launch` (when Accelerate is installed)
  fabric      the same loop under Lightning Fabric, which launches itself (when installed)

The job: scikit-learn's 8x8 digits (1438 train / 359 test, the same split everywhere), the
default small CNN, global batch 64 over 2 CPU processes, SGD (Nesterov momentum 0.9, lr 0.05,
weight decay 5e-4, cosine decay), 10 epochs, the test set evaluated after every epoch. The
baselines are plain scripts in `benchmarks/baselines/` (they share only the data and model
definitions, which import NumPy and torch).

Every run is a fresh process started by `subprocess`, timed from start to exit. Rounds run
every contender once, in an order rotated from round to round (and reversed every other cycle of
rotations, see round_order), after one untimed warm-up round
(not with --quick) that fills the page cache for everyone. Reported: the median and spread of
each contender's wall time, the final test accuracy each reached (the proof that they did the
same job), and for ddpkit the run's own `wall_seconds` from results.json, so the part spent
outside it (interpreter, imports and argument parsing before; outputs and exit after) can be
read off, and the median of each phase of its results.json "timeline" (imports, checks,
workers' start, process group, data, model, first step, training, outputs, workers' exit, and
the exit seen from outside: `ddpkit bench startup` measures the same breakdown alone). Each
contender's rank 0 also times its steady training steps the same way (ddpkit's StepTimer in
results.json; `StepClock` in the baselines: from one step's end to the next's, data included,
steps of a new input shape left out), so the training loop's own cost can be told apart from
the launch's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from ddpkit.bench.startup import command_environ

from .paired import paired_ratio

DESCRIPTION = "whole-command wall time of a small 2-process CPU job: ddpkit train vs torchrun, Accelerate, Fabric"

CONTENDERS = ("ddpkit", "torchrun", "accelerate", "fabric")
NPROC = 2
JOB = {
    "data": "digits (8x8, 1438 train / 359 test)",
    "model": "cnn (ddpkit's small_cnn)",
    "processes": NPROC,
    "device": "cpu",
    "global_batch_size": 64,
    "optimizer": "SGD nesterov momentum 0.9, lr 0.05, wd 5e-4, cosine",
    "evaluation": "whole test set after every epoch",
}
BASELINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines")
_FINAL = re.compile(r"final test accuracy ([0-9.]+)")
_STEPS = re.compile(r"step ms p50 ([0-9.naninf]+) mean ([0-9.naninf]+)")
RUN_TIMEOUT_S = 600
TARGET_RATIO = 0.7  # issue 14: ddpkit's median at most 0.7x the best peer's


def add_arguments(parser: Any) -> None:
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the job (default 10)")
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)} (default all; ddpkit always runs)",
    )


def _selected(opts: Any) -> list[str]:
    from ddpkit.errors import UsageError

    names = [n.strip() for n in str(opts.extra.get("contenders") or ",".join(CONTENDERS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise UsageError(f"--contenders: unknown {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    return ["ddpkit", *[n for n in CONTENDERS[1:] if n in names]]


def _missing(name: str) -> str | None:
    """Why a contender cannot run here, or None."""
    module = {"accelerate": "accelerate", "fabric": "lightning"}.get(name)
    if module and importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install 'ddpkit[bench]')"
    return None


def command(name: str, out: str, epochs: int) -> list[str]:
    py = sys.executable
    if name == "ddpkit":
        return [
            py,
            "-m",
            "ddpkit",
            "train",
            "--nproc",
            str(NPROC),
            "--device",
            "cpu",
            "--epochs",
            str(epochs),
            "--out",
            out,
        ]
    if name == "torchrun":
        return [
            py,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",  # port 0: the OS picks a free one
            os.path.join(BASELINES, "torchrun_digits.py"),
        ]
    if name == "accelerate":
        return [
            py,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(NPROC),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
            os.path.join(BASELINES, "accelerate_digits.py"),
        ]
    return [py, os.path.join(BASELINES, "fabric_digits.py")]


def _env(tmp: str, epochs: int) -> dict[str, str]:
    # As `ddpkit bench startup` runs it (see command_environ), for every contender alike;
    # OMP_NUM_THREADS goes too (a launcher's variable), so each launcher applies its own default.
    env = command_environ()
    env["DIGITS_EPOCHS"] = str(epochs)  # read by the baselines' digits_job.py
    env["HF_HOME"] = os.path.join(tmp, "hf")  # no saved `accelerate config` changes what is measured
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_once(name: str, epochs: int, tmp: str) -> dict[str, Any]:
    """One whole command, timed from start to exit: seconds, accuracy, and ddpkit's own clock."""
    out = tempfile.mkdtemp(prefix=f"{name}-", dir=tmp)
    cmd = command(name, out, epochs)
    t = time.perf_counter()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=_env(tmp, epochs),
        cwd=out,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{name} exited with {proc.returncode}: {' '.join(cmd)}\n{tail}")
    run: dict[str, Any] = {"seconds": seconds}
    if name == "ddpkit":
        from ddpkit.bench.startup import run_phases

        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)
        run.update(
            test_accuracy=results["test_accuracy"],
            results_wall_seconds=results["wall_seconds"],
            phases=run_phases(results["timeline"], seconds),
        )
        steps = results.get("step_time_ms")
        if steps:
            run["step_ms"] = {"p50": steps["p50"], "mean": steps["mean"]}
    else:
        found = _FINAL.findall(proc.stdout)
        run["test_accuracy"] = float(found[-1]) if found else None
        if timed := _STEPS.findall(proc.stdout):
            run["step_ms"] = {"p50": float(timed[-1][0]), "mean": float(timed[-1][1])}
    return run


def run(opts: Any, device: str) -> dict[str, Any]:
    """The job on the CPU whatever `device` says: the contenders are compared on CPU processes."""
    from ddpkit.errors import UsageError

    epochs = int(opts.extra.get("epochs") or 10)
    if epochs < 1:
        raise UsageError(f"--epochs must be positive, got {epochs}")
    selected = _selected(opts)
    skipped = {n: why for n in selected if (why := _missing(n))}
    skipped.update({n: "not selected (--contenders)" for n in CONTENDERS if n not in selected})
    rounds = opts.reps(default=5, quick=2)
    retried: dict[str, list[str]] = {}  # a baseline's failed runs that were run again
    runs = _rounds([n for n in selected if n not in skipped], epochs, rounds, 0 if opts.quick else 1, skipped, retried)
    contenders = {n: _contender(n, r, epochs) for n, r in runs.items()}
    best = contenders["ddpkit"]["wall_seconds"]["median"]
    others = {n: c for n, c in contenders.items() if n != "ddpkit"}
    return {
        "job": {**JOB, "epochs": epochs},
        "rounds": rounds,
        "warmup_rounds": 0 if opts.quick else 1,
        "contenders": contenders,
        "skipped": skipped,
        "retried": retried,
        **versus_best_peer(contenders),
        "ddpkit_fastest": all(best < c["wall_seconds"]["median"] for c in others.values()),
        # how many times longer the other's whole command takes (median over median)
        "speedup_vs": {n: c["wall_seconds"]["median"] / best for n, c in others.items()},
        "versions": {n: _version(n) for n in contenders},
    }


def versus_best_peer(contenders: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The target: ddpkit's median whole command over the best (lowest) median among the
    other contenders, at most TARGET_RATIO. None where no other contender ran."""
    medians = {n: c["wall_seconds"]["median"] for n, c in contenders.items() if n != "ddpkit"}
    best = min(medians, key=medians.__getitem__) if medians else None
    ratio = contenders["ddpkit"]["wall_seconds"]["median"] / medians[best] if best else None
    return {
        "target": f"ddpkit's whole command at most {TARGET_RATIO}x the best other contender's (median over median)",
        "target_ratio": TARGET_RATIO,
        "best_peer": best,
        "ddpkit_over_best_peer": ratio,
        "target_met": ratio <= TARGET_RATIO if ratio is not None else None,
        "paired": paired_by_round(contenders["ddpkit"], contenders[best]) if best else None,
    }


def paired_by_round(kit: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any] | None:
    """ddpkit's whole command over the peer's in the same round (the two ran back to back, so a
    slow spell of the machine weighs on both): the median of those ratios, a 95% bootstrap
    interval of it, and the verdict on TARGET_RATIO ("not resolved" while the interval holds it,
    and below paired.MIN_ROUNDS rounds). None for records made before the rounds were kept."""
    kit_s, peer_s = kit.get("seconds_per_round"), peer.get("seconds_per_round")
    if not kit_s or not peer_s or len(kit_s) != len(peer_s):
        return None
    # a whole command's ratio, 0.7: any interval wholly below the target meets it
    p = paired_ratio(peer_s, kit_s, TARGET_RATIO, resolution=math.inf)
    return {
        "median": p["ratio"],
        "interval95": p["interval95"],
        "status": p["status"],
        "per_round": p["ratio_per_round"],
    }


def _rounds(
    names: list[str], epochs: int, rounds: int, warmup: int, skipped: dict[str, str], retried: dict[str, list[str]]
) -> dict[str, list]:
    """{name: timed runs}. Each round runs every contender once; a baseline whose run fails is
    run once more (its failure kept in `retried`: a peer's launcher may meet a passing fault on
    a busy machine, as one CI run's torchrun did), and one that fails again is moved to `skipped`
    (a broken one must not hide the others); a failing ddpkit is an error."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-startup-") as tmp:
        for r in range(warmup + rounds):
            for name in round_order(names, r):
                if name in skipped:
                    continue
                try:
                    one = _run_retrying(name, epochs, tmp, retried)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    if name == "ddpkit":
                        raise
                    skipped[name] = f"failed: {err}"
                    runs.pop(name)
                    continue
                if r >= warmup:
                    runs[name].append(one)
                acc = one["test_accuracy"]
                print(
                    f"  startup: round {r + 1 - warmup}{' (warm-up)' if r < warmup else ''} {name:<10} "
                    f"{one['seconds']:6.2f} s" + (f"  accuracy {acc:.4f}" if acc is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def _run_retrying(name: str, epochs: int, tmp: str, retried: dict[str, list[str]]) -> dict[str, Any]:
    """`run_once`, and for a baseline that fails, once more (its failure kept in `retried`)."""
    try:
        return run_once(name, epochs, tmp)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        if name == "ddpkit":
            raise
        retried.setdefault(name, []).append(str(err))
        print(f"  startup: {name} failed, run once more: {err}", file=sys.stderr, flush=True)
        return run_once(name, epochs, tmp)


def round_order(names: list[str], r: int) -> list[str]:
    """Round `r`'s order: rotated every round (nobody always first, cold, or last) and reversed
    every other cycle of rotations, so that over 2 x len(names) rounds each contender runs
    before each other one as often as after it (a rotation alone puts the first of four before
    the second in 3 rounds of 4), which the rounds' paired ratios rely on."""
    n = len(names)
    rotated = names[r % n :] + names[: r % n]
    return rotated if (r // n) % 2 == 0 else rotated[::-1]


def _contender(name: str, runs: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    from ddpkit.bench.common import stats
    from ddpkit.bench.startup import phase_stats

    accuracies = [r["test_accuracy"] for r in runs]
    cmd = command(name, "DIR", epochs)
    entry: dict[str, Any] = {
        "command": " ".join(["python", *(os.path.basename(a) if a.endswith(".py") else a for a in cmd[1:])]),
        "wall_seconds": stats([r["seconds"] for r in runs]),
        "seconds_per_round": [r["seconds"] for r in runs],
        "test_accuracy": accuracies[-1] if accuracies else None,
        "test_accuracies": accuracies,
    }
    timed = [r["step_ms"] for r in runs if "step_ms" in r]
    if timed:
        # rank 0's steady training steps, each run's median and mean (ms): the loop's cost
        entry["step_ms"] = {k: stats([t[k] for t in timed]) for k in ("p50", "mean")}
    if name == "ddpkit":
        # results.json's wall_seconds runs from train() in the parent to the end of the last
        # evaluation; the rest is the interpreter and imports before it, outputs and exit after.
        entry["results_wall_seconds"] = stats([r["results_wall_seconds"] for r in runs])
        entry["outside_results_wall_seconds"] = stats([r["seconds"] - r["results_wall_seconds"] for r in runs])
        # where its time went: each phase of results.json's timeline (see `ddpkit bench startup`)
        entry["phases"] = phase_stats(runs) if runs else {}
    return entry


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({"ddpkit": "ddpkit", "torchrun": "torch", "fabric": "lightning"}.get(name, name))
    except PackageNotFoundError:
        return None


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    names = sorted(r["contenders"], key=lambda n: r["contenders"][n]["wall_seconds"]["median"], reverse=True)
    walls = [r["contenders"][n]["wall_seconds"] for n in names]
    med = [w["median"] for w in walls]
    err = [[m - w["min"] for m, w in zip(med, walls)], [w["max"] - m for m, w in zip(med, walls)]]
    colors = ["tab:blue" if n == "ddpkit" else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.6 * len(names)))
    ax.barh(names, med, xerr=err, color=colors, capsize=4)
    for i, (n, m, w) in enumerate(zip(names, med, walls)):
        acc = r["contenders"][n]["test_accuracy"]
        ax.text(
            w["max"],
            i,
            f"  {m:.2f} s" + (f"  (accuracy {acc:.3f})" if acc is not None else ""),
            va="center",
            fontsize=9,
        )
    target = versus_best_peer(r["contenders"])
    if target["best_peer"] is not None:  # where ddpkit's median must be: 0.7x the best peer's
        at = target["target_ratio"] * r["contenders"][target["best_peer"]]["wall_seconds"]["median"]
        label = f"target: {target['target_ratio']}x {target['best_peer']}'s median"
        ax.axvline(at, color="tab:red", linestyle="--", linewidth=1, label=label)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("whole command, seconds (median; whiskers min-max)")
    ax.set_xlim(0, max(w["max"] for w in walls) * 1.45)
    job = r["job"]
    ax.set_title(
        f"{job['epochs']} epochs of digits on {job['processes']} CPU processes, {r['rounds']} rounds", fontsize=10
    )
    save_figure(fig, path, dpi=120)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, c in sorted(result["contenders"].items(), key=lambda kv: kv[1]["wall_seconds"]["median"]):
        w = c["wall_seconds"]
        acc = f", accuracy {c['test_accuracy']:.4f}" if c["test_accuracy"] is not None else ""
        rows.append(
            (f"{name} whole command (median of {w['n']})", f"{w['median']:.2f} s [{w['min']:.2f}-{w['max']:.2f}]{acc}")
        )
    outside = result["contenders"]["ddpkit"].get("outside_results_wall_seconds")
    if outside:
        rows.append(("ddpkit outside results.json's wall_seconds", f"{outside['median']:.2f} s"))
    phases = result["contenders"]["ddpkit"].get("phases") or {}
    rows += [(f"ddpkit phase {name} (median)", f"{s['median']:.3f} s") for name, s in phases.items()]
    for name, ratio in result["speedup_vs"].items():
        rows.append((f"{name} / ddpkit", f"{ratio:.2f}x"))
    rows.append(("ddpkit fastest", "yes" if result["ddpkit_fastest"] else "no"))
    if result["best_peer"]:
        verdict = "met" if result["target_met"] else "not met"
        rows.append(
            (
                f"ddpkit / best peer ({result['best_peer']})",
                f"{result['ddpkit_over_best_peer']:.3f}x (target <= {result['target_ratio']}: {verdict})",
            )
        )
    paired = result.get("paired")
    if paired:
        low, high = paired["interval95"]
        rows.append(
            (
                f"ddpkit / {result['best_peer']}, paired by round (median, 95% CI)",
                f"{paired['median']:.3f}x [{low:.3f}, {high:.3f}] (target <= {result['target_ratio']}: "
                f"{paired['status']})",
            )
        )
    for name, c in result["contenders"].items():
        if "step_ms" in c:
            p50, mean = c["step_ms"]["p50"]["median"], c["step_ms"]["mean"]["median"]
            rows.append((f"{name} training step, rank 0 (median of runs)", f"p50 {p50:.2f} ms, mean {mean:.2f} ms"))
    rows += [(f"{name} skipped", why.splitlines()[0]) for name, why in result["skipped"].items()]
    rows += [
        (f"{name} run again after a failure", errors[0].splitlines()[0])
        for name, errors in result.get("retried", {}).items()
    ]
    return rows
