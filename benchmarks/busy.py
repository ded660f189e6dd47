"""`python -m benchmarks busy`: `ddpkit train` on a busy machine, under each thread setting.

A newcomer's machine is rarely idle: two torch jobs started together each size their thread
pool to every core, and the pools fight over the cores (an OpenMP thread spins while it waits
for the others). This benchmark times, from outside, the README's first command
(`ddpkit train --out DIR`, the built-in default: digits, one process) in two situations:

  together  two such commands started at the same moment, until both have exited;
  alone     one such command;

under each thread setting:

  default   what ddpkit chooses (nothing set: its share of the usable cores, less those other
            programs kept busy while it started; see ddpkit.core.threads);
  share     DDPKIT_THREADS=share: its share of the usable cores whatever the load, ddpkit's
            default before it read the load;
  one       OMP_NUM_THREADS=1, what a user who knows this sets.

Rounds run every (setting, situation) once, in an order rotated from round to round, after
an untimed warm-up run. The goals of issue 27, part 1, are checked on the medians:
`together` under the default at most 1.3x `together` at one thread, and `alone` under the
default no slower than under `share` (within ALONE_NOISE). results/busy-cpu-before.json holds
the same benchmark before the load was read (its `default` was `share`, and a `passive` setting,
OMP_WAIT_POLICY=PASSIVE, ran too: it took 1.46x one thread's time together and 1.14x the
default's alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ddpkit.bench.common import stats
from ddpkit.bench.startup import command_environ

DESCRIPTION = "whole ddpkit train commands started together and alone, under each thread setting (CPU)"

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "share": {"DDPKIT_THREADS": "share"},
    "one": {"OMP_NUM_THREADS": "1"},
}
SITUATIONS = {"together": 2, "alone": 1}  # how many commands run at once
TOGETHER_GOAL = 1.3  # issue 27: two together under the default, at most 1.3x two at one thread
ALONE_NOISE = 1.05  # alone under the default no slower than under share: within 5%
RUN_TIMEOUT_S = 600


def add_arguments(parser: Any) -> None:
    parser.add_argument("--epochs", type=int, default=10, help="epochs of each command (default 10, the default's)")


def run(opts: Any, device: str) -> dict[str, Any]:
    """On the CPU whatever `device` says: the contention is for CPU cores."""
    from ddpkit.errors import UsageError

    epochs = int(opts.extra.get("epochs") or 10)
    if epochs < 1:
        raise UsageError(f"--epochs must be positive, got {epochs}")
    rounds = opts.reps(default=3, quick=1)
    cases = [(s, w) for s in SETTINGS for w in SITUATIONS]
    times: dict[str, list[float]] = {f"{s} {w}": [] for s, w in cases}
    threads: dict[str, list[int]] = {f"{s} {w}": [] for s, w in cases}  # what each command ran
    with tempfile.TemporaryDirectory(prefix="ddpkit-busy-") as tmp:
        if not opts.quick:
            _commands(tmp, {}, 1, epochs, [])  # untimed: fills the page cache, writes the bytecode
        for r in range(rounds):
            for setting, situation in cases[r % len(cases) :] + cases[: r % len(cases)]:
                name = f"{setting} {situation}"
                times[name].append(_commands(tmp, SETTINGS[setting], SITUATIONS[situation], epochs, threads[name]))
    cases_out = {name: stats(values) for name, values in times.items()}
    median = {name: s["median"] for name, s in cases_out.items()}
    together = median["default together"] / median["one together"]
    alone = median["default alone"] / median["share alone"]
    return {
        "command": f"ddpkit train --epochs {epochs} --out DIR (digits, one process, its defaults)",
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "rounds": rounds,
        "cases": cases_out,
        "threads": {name: sorted(set(counts)) for name, counts in threads.items()},
        "settings": SETTINGS,
        "default_together_over_one_together": together,
        "together_goal": TOGETHER_GOAL,
        "together_goal_met": together <= TOGETHER_GOAL,
        "share_together_over_one_together": median["share together"] / median["one together"],
        "alone_default_over_share": alone,
        "alone_goal": ALONE_NOISE,
        "alone_goal_met": alone <= ALONE_NOISE,
        "alone_default_over_one": median["default alone"] / median["one alone"],
    }


def _commands(tmp: str, setting: dict[str, str], count: int, epochs: int, threads: list[int]) -> float:
    """Seconds from starting `count` commands at once until the last has exited; the torch threads
    each ran (results.json's `threads`) are added to `threads`."""
    env = {
        **command_environ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "DDPKIT_THREADS"),
        **setting,
        "PYTHONUNBUFFERED": "1",
    }
    outs = [tempfile.mkdtemp(prefix="run-", dir=tmp) for _ in range(count)]
    argv = [sys.executable, "-m", "ddpkit", "train", "--epochs", str(epochs), "--device", "cpu", "--nproc", "1"]
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*argv, "--out", os.path.join(out, "run")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for out in outs
    ]
    errors = [p.communicate(timeout=RUN_TIMEOUT_S)[1] for p in procs]
    seconds = time.perf_counter() - t
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise RuntimeError(f"ddpkit train exited with {p.returncode}: {err.strip()[-1500:]}")
    for out in outs:
        with open(os.path.join(out, "run", "results.json")) as f:
            threads.append(json.load(f)["threads"])
    return seconds


def plot(record: dict[str, Any], path: str) -> None:
    from ddpkit.observe.plots import pyplot, save_figure

    plt = pyplot()
    r = record["result"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, situation in zip(axes, SITUATIONS):
        names = list(SETTINGS)
        cases = [r["cases"][f"{n} {situation}"] for n in names]
        med = [c["median"] for c in cases]
        err = [[m - c["min"] for m, c in zip(med, cases)], [c["max"] - m for m, c in zip(med, cases)]]
        ax.barh(names, med, xerr=err, capsize=4, color=["tab:blue", "tab:gray", "tab:green"])
        for i, (m, c) in enumerate(zip(med, cases)):
            ax.text(c["max"], i, f"  {m:.2f} s", va="center", fontsize=9)
        ax.set_xlim(0, max(c["max"] for c in cases) * 1.3)
        count = SITUATIONS[situation]
        ax.set_title(f"{situation}: {count} command{'s' if count > 1 else ''} at once", fontsize=10)
        ax.set_xlabel("seconds until the last exits (median; whiskers min-max)")
    if r["together_goal"]:
        at = r["together_goal"] * r["cases"]["one together"]["median"]
        axes[0].axvline(at, color="tab:red", linestyle="--", linewidth=1, label=f"goal: {r['together_goal']}x one")
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"ddpkit train on a busy machine: {r['cores']} cores, {r['rounds']} rounds", fontsize=11)
    save_figure(fig, path, dpi=120)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for name, s in result["cases"].items():
        ran = result.get("threads", {}).get(name)
        threads = f", {'/'.join(map(str, ran))} thread{'s' if ran != [1] else ''}" if ran else ""
        rows.append((f"{name} (median of {s['n']})", f"{s['median']:.2f} s [{s['min']:.2f}-{s['max']:.2f}]{threads}"))
    verdict = "met" if result["together_goal_met"] else "not met"
    rows.append(
        (
            "default together / one together",
            f"{result['default_together_over_one_together']:.2f}x (goal <= {result['together_goal']}: {verdict})",
        )
    )
    rows.append(("share together / one together", f"{result['share_together_over_one_together']:.2f}x"))
    verdict = "met" if result["alone_goal_met"] else "not met"
    rows.append(
        (
            "default alone / share alone",
            f"{result['alone_default_over_share']:.2f}x (goal <= {result['alone_goal']}: {verdict})",
        )
    )
    rows.append(("default alone / one alone", f"{result['alone_default_over_one']:.2f}x"))
    return rows
