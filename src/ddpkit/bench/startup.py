"""`ddpkit bench startup`: where the wall time of a small `ddpkit train` goes, from the
command's start to its exit.

Each repetition runs the real command, `python -m ddpkit train --nproc 2 --device cpu
--epochs 10 --out DIR` (scikit-learn's 8x8 digits, the default small CNN), as a fresh
process, timed from outside from start to exit, and reads the moments the run wrote in
results.json's "timeline" (seconds since the command's process started; see
`ddpkit.observe.timeline.MOMENTS`). A phase is the time between a moment and the one before it:
interpreter and imports, checks, the launcher and the workers' start, the process group, the
data, the model, the first step, the rest of training (with each epoch's evaluation and
checkpoint), the outputs, the workers' exit, and `exit`: from the last moment to the end
of the process, as the outside clock sees it (the parent's interpreter teardown).

Reported: the median and spread of each phase and of the whole command over the
repetitions (after one untimed warm-up run, not with --quick, that fills the page cache).
The job runs on CPU processes whatever --device says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# Imports inside functions: `ddpkit bench --help` imports every benchmark module for its
# DESCRIPTION, so torch and ddpkit's heavier parts load only when a benchmark runs.

DESCRIPTION = "start-up to exit of `ddpkit train --nproc 2` on digits: the time of each phase, median and spread"
# Its files are startup-phases-DEVICE.*: `python -m benchmarks startup`, the comparison with the
# other launchers, writes startup-DEVICE.* in the same folder.
RESULT_NAME = "startup-phases"

NPROC = 2
RUN_TIMEOUT_S = 600
EXIT = "exit"  # the phase after the last moment: the process's end, seen from outside


def add_arguments(parser: Any) -> None:
    parser.add_argument("--epochs", type=int, default=0, help="epochs of the job (default 10; --quick 2)")


def command(out: str, epochs: int) -> list[str]:
    """The measured command line."""
    return [sys.executable, "-m", "ddpkit", "train", "--nproc", str(NPROC), "--device", "cpu"] + [
        "--epochs",
        str(epochs),
        "--out",
        out,
    ]


def command_environ(*also: str) -> dict[str, str]:
    """The environment of a measured command: this one's, without a launcher's variables (a
    run started from inside another job must not inherit them) nor PYTHONDONTWRITEBYTECODE,
    so that Python keeps the compiled bytecode of ddpkit's own modules as on any install:
    without a cache every run compiles them again (about 0.09 s), which a pip-installed
    package, compiled when installed, never does. (The untimed warm-up run writes the
    cache.) `also`: more variables to leave out."""
    from ..core.dist import environ_outside_job

    return environ_outside_job("PYTHONDONTWRITEBYTECODE", *also)


def run_once(epochs: int, tmp: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One whole command, timed from outside: its seconds, results.json's timeline, the
    phases (with `exit`), and the test accuracy it reached (the proof that it trained)."""
    out = tempfile.mkdtemp(prefix="train-", dir=tmp)
    env = env if env is not None else command_environ()
    t = time.perf_counter()
    proc = subprocess.run(
        command(out, epochs),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=out,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"ddpkit train exited with {proc.returncode}:\n{tail}")
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    return {
        "seconds": seconds,
        "timeline": results["timeline"],
        "phases": run_phases(results["timeline"], seconds),
        "test_accuracy": results["test_accuracy"],
        "wall_seconds": results["wall_seconds"],
    }


def run_phases(timeline: dict[str, float], seconds: float) -> dict[str, float]:
    """A run's phases, in order, from its timeline and its whole seconds seen from outside."""
    from ..observe.timeline import phases

    out = phases(timeline)
    out[EXIT] = max(0.0, seconds - max(timeline.values()))
    return out


def phase_stats(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Median and spread of each phase over runs (in the phases' order)."""
    from .common import stats

    names = [n for n in runs[0]["phases"] if all(n in r["phases"] for r in runs)]
    return {n: stats([r["phases"][n] for r in runs]) for n in names}


def run(opts: Any, device: str) -> dict[str, Any]:
    """The job on the CPU whatever `device` says: start-up is measured on CPU processes."""
    from ..errors import UsageError
    from ..observe.timeline import MOMENTS
    from .common import stats

    epochs = int(opts.extra.get("epochs") or (2 if opts.quick else 10))
    if epochs < 1:
        raise UsageError(f"--epochs must be positive, got {epochs}")
    reps, warmup = opts.reps(default=5, quick=1), 0 if opts.quick else 1
    runs = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-startup-") as tmp:
        for i in range(warmup + reps):
            one = run_once(epochs, tmp)
            print(
                f"  startup: run {i + 1 - warmup}{' (warm-up)' if i < warmup else ''} {one['seconds']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
            if i >= warmup:
                runs.append(one)
    return {
        "command": " ".join(["python", *command("DIR", epochs)[1:]]),
        "epochs": epochs,
        "processes": NPROC,
        "repetitions": reps,
        "warmup_runs": warmup,
        "whole_seconds": stats([r["seconds"] for r in runs]),
        "phases": phase_stats(runs),
        "phase_meaning": {**MOMENTS, EXIT: "the parent's exit after the last moment, seen from outside"},
        "runs": runs,
    }


def plot(record: dict[str, Any], path: str) -> None:
    """One stacked bar per run and one of the medians: each phase's seconds, in order."""
    from ..observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    names = list(r["phases"])
    bars = [("median", {n: r["phases"][n]["median"] for n in names})]
    bars += [(f"run {i + 1}", run["phases"]) for i, run in enumerate(r["runs"])]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.4 * len(bars)))
    colors = plt.get_cmap("tab20").colors
    for j, name in enumerate(names):
        lefts = [sum(p.get(n, 0.0) for n in names[:j]) for _, p in bars]
        widths = [p.get(name, 0.0) for _, p in bars]
        ax.barh([label for label, _ in bars], widths, left=lefts, color=colors[j % len(colors)], label=name)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the command's process started")
    w = r["whole_seconds"]
    ax.set_title(
        f"ddpkit train --nproc {r['processes']}, {r['epochs']} epochs of digits: whole command "
        f"{w['median']:.2f} s (median of {w['n']})",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / len(bars)))
    save_figure(fig, path, dpi=120)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    w = result["whole_seconds"]
    rows = [(f"whole command (median of {w['n']})", f"{w['median']:.2f} s [{w['min']:.2f}-{w['max']:.2f}]")]
    for name, s in result["phases"].items():
        rows.append((f"  {name}", f"{s['median']:.3f} s [{s['min']:.3f}-{s['max']:.3f}]"))
    return rows
