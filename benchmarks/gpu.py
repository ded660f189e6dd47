"""`python -m benchmarks gpu`: one command that checks ddpkit's GPU paths on a real GPU, and
measures them, within a window of a few minutes on a machine with no network.

    python -m benchmarks gpu --prepare        # here, with a network: wheels the GPU image lacks
    python -m benchmarks gpu --dry-run        # the plan and its time budget, anywhere
    python -m benchmarks gpu --results DIR    # on the GPU machine: set up, test, measure, report

On a machine without a CUDA device it says so in one line, lists what it would run and exits 0.
`--device cpu` rehearses the whole plan on CPU at smoke sizes (results in a temporary folder
unless --results names one): it checks the check, not the GPU.

The steps run one after another, each a subprocess with a time limit of its own, inside one
budget for the whole (`--budget`, 480 s: the 8 minutes a GPU window allows). A step that fails
or runs out of time is reported and the next one runs; a step whose estimate no longer fits the
budget is skipped and says so (the check then exits 1, as when a step fails). The whole output is at most 8 files in `--results`, so it can be
carried back from a machine that returns 8 files: one JSON per measurement (NAME-cuda.json,
hardware, versions and date inside), the CUDA tests' outcomes (tests-cuda.json), the check's own
record (gpu-check-cuda.json: set-up, environment, every step's status, figure, seconds and output
tail) and the table (SUMMARY-gpu-cuda.md), which is also printed at the end. Both are rewritten
after every step, so a check stopped from outside still leaves what it did.

This module imports only the standard library until its steps run: on the GPU machine ddpkit is
not installed yet when it starts (the set-up step installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m benchmarks gpu"
BUDGET_S = 480.0  # the 8 minutes of wall time the check may take on one H200
# A rehearsal on CPU (--device cpu) gives every step this many times its time: a few CPU cores
# compile and train more slowly than a GPU, and the rehearsal checks the check, not the speed.
REHEARSAL_SLACK = 3.0
WHEELS = ".gpu-wheels"  # git-ignored: the wheels --prepare fetches, carried to the GPU machine
SITE = ".gpu-site"  # git-ignored: where the set-up step installs those wheels
# ddpkit's requirements that the GPU machine's image lacks (its package list, 2026-11-17: it has
# torch 2.11, numpy, scikit-learn, matplotlib, pyyaml, tqdm, cloudpickle, pytest, pytest-timeout).
IMAGE_LACKS = ("simple-parsing", "docstring-parser")
WHEEL_PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64")
AIRBENCH94_A100_S = 3.83  # airbench94's published time to 94% on CIFAR-10, one A100
MIN_PARITY_STEP_MS = 5.0  # the parity model must be big enough for a step of at least this
OUTPUT_TAIL = 3000  # characters of a step's output kept in gpu-check-cuda.json


@dataclass(frozen=True)
class Step:
    """One check: what it runs, how long it should take (estimate, on one H200) and may take
    (limit), the result file it writes, and how its outcome is judged from that file."""

    name: str
    what: str
    estimate_s: float
    limit_s: float
    argv: Callable[[Context], list[str]] | None = None  # None: runs in this process (setup)
    result: str | None = None  # NAME-cuda.json under --results
    judge: Callable[[dict[str, Any], Context], tuple[str, str]] | None = None  # (status, figure)
    plots: str | None = None  # the module whose plot(record, path) draws the result (--replot)


@dataclass
class Context:
    device: str  # "cuda", or "cpu" for a rehearsal
    results: str
    scratch: str  # plots and logs that are not carried back
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # set-up and `ddpkit env --json`

    @property
    def rehearsal(self) -> bool:
        return self.device != "cuda"

    def out(self, name: str) -> str:
        return os.path.join(self.results, f"{name}-{'cuda' if not self.rehearsal else 'cpu-rehearsal'}.json")

    def bench(self, name: str, *flags: str) -> list[str]:
        """`ddpkit bench NAME` writing its JSON to --results and its plot to the scratch folder."""
        quick = ["--quick"] if self.rehearsal else []
        return [
            *("-m", "ddpkit", "bench", name, "--device", self.device, *quick, *flags),
            *("--json", self.out(name), "--plot", os.path.join(self.scratch, f"{name}.png")),
        ]


# -- the steps ------------------------------------------------------------------------------------


def _tests_argv(ctx: Context) -> list[str]:
    junit = os.path.join(ctx.scratch, "junit.xml")
    # A test that hangs is stopped by pytest-timeout, well inside the step's limit, and the others run.
    timeout = "--timeout=300" if ctx.rehearsal else "--timeout=120"
    return [
        "-m",
        "pytest",
        "-m",
        "cuda",
        "tests/test_cuda.py",
        "-q",
        "-p",
        "no:cacheprovider",
        timeout,
        f"--junitxml={junit}",
    ]


def _parity_argv(ctx: Context) -> list[str]:
    # resnet18 at batch 512 on 32x32 images: about 1.7 TFLOP a step, over 5 ms on a data-center
    # GPU (the default cnn at 16x16 takes well under one); 12 rounds: enough for a verdict.
    size = ["--quick"] if ctx.rehearsal else ["--model", "resnet18", "--image-size", "32", "--batch-size", "512"]
    rounds = ["--nproc", "1"] if ctx.rehearsal else ["--rounds", "12", "--steps", "20"]
    return [
        *("-m", "benchmarks", "parity", "--device", ctx.device, *size, *rounds),
        *("--json", ctx.out("parity"), "--plot", os.path.join(ctx.scratch, "parity.png")),
    ]


def _result_of(record: dict[str, Any]) -> dict[str, Any]:
    return record.get("result", record)


def _gpu_names(env: dict[str, Any]) -> str:
    return ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env.get("gpus") or [])


def _judge_env(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    torch_version = record["torch"]["version"]
    backends = ", ".join(k for k, v in record["distributed_backends"].items() if v)
    figure = f"torch {torch_version}, cuDNN {record['cuda']['cudnn']}, NCCL {record['cuda']['nccl']}, {backends}"
    if ctx.rehearsal:
        return "pass", figure + "; a rehearsal on CPU"
    gpus = record["gpus"]
    return ("pass" if gpus else "fail"), f"{len(gpus)} GPU(s): {_gpu_names(record) or 'none seen'}; {figure}"


def _judge_tests(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    c = record["counts"]
    figure = f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped"
    failed = [t["name"] for t in record["tests"] if t["outcome"] in ("failed", "error")]
    if failed:
        figure += ": " + ", ".join(failed[:4]) + (" ..." if len(failed) > 4 else "")
    return ("pass" if c["passed"] and not (c["failed"] or c["errors"]) else "fail"), figure


def _judge_parity(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    r = _result_of(record)
    single = r["one_process"]["strategies"]["single"]
    step_ms = single["us_per_step"]["hand_written"]["median"] / 1e3
    wall = single["wall"]
    figure = (
        f"single: ddpkit / hand-written {wall['ratio']:.3f} [{wall['interval95'][0]:.3f}, "
        f"{wall['interval95'][1]:.3f}] {wall['status']}, hand-written step {step_ms:.1f} ms, "
        f"weights bitwise equal: {'yes' if r['weights_equal'] else 'no'}"
    )
    if step_ms < MIN_PARITY_STEP_MS and not ctx.rehearsal:
        return "fail", figure + f" (a step under {MIN_PARITY_STEP_MS:g} ms: raise --batch-size)"
    return "pass", figure


def _judge_loader(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    r = _result_of(record)
    speedups = ", ".join(f"{p} {s:.1f}x" for p, s in r["speedup_by_pipeline"].items())
    same = all(r["identical_batches"].values())
    return ("pass" if same else "fail"), f"resident / best DataLoader: {speedups}; same batches: {same}"


def _judge_gpt(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    r = _result_of(record)
    mfu = r["mfu"]["counted"]
    mfu_text = f"MFU {100 * mfu:.1f}% of {r['peak_tflops']:g} TFLOP/s" if mfu is not None else "MFU n/a (no peak)"
    figure = (
        f"{r['parameters']:,} params, {r['work']['precision']}: {r['tokens_per_second']['median']:,.0f} "
        f"tokens/s, {r['step_ms']['median']:.1f} ms/step, {mfu_text}"
    )
    ok = r["loss_finite"] and (mfu is not None or ctx.rehearsal)
    return ("pass" if ok else "fail"), figure


def _judge_fast_cifar(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    r = _result_of(record)
    seconds = r["epoch_seconds_per_run"][-1]
    hit = r["time_to_target"][-1]
    reached = (
        f"{r['target_accuracy']:.0%} reached after {hit['training_seconds']:.2f} s (epoch {hit['epoch']})"
        if hit
        else f"{r['target_accuracy']:.0%} not reached"
    )
    figure = (
        f"{r['epochs']} epochs of {r['synthetic_size']:,} SYNTHETIC CIFAR-shaped samples: {sum(seconds):.2f} s "
        f"training ({r['median_epoch_seconds']:.2f} s/epoch after the first), {reached} on that synthetic data; "
        f"airbench94: {AIRBENCH94_A100_S} s to 94% on real CIFAR-10, A100 (published)"
    )
    return "pass", figure


def _judge_precision(record: dict[str, Any], ctx: Context) -> tuple[str, str]:
    r = _result_of(record)
    by = {v["variant"]: v for v in r["variants"]}
    parts = [f"{name} {v['speedup_vs_fp32']:.2f}x" for name, v in by.items() if name != "fp32"]
    bad = [name for name, v in by.items() if not v["loss_finite"]]
    bad += [f"{name} (no GradScaler)" for name, v in by.items() if v["precision"] == "fp16" and not v["grad_scale"]]
    compiled = [f"{n} {v['compile_seconds']:.0f} s" for n, v in by.items() if v.get("compile_seconds") is not None]
    figure = "over fp32: " + ", ".join(parts) + (f"; compile: {', '.join(compiled)}" if compiled else "")
    figure += f"; NOT trained: {', '.join(bad)}" if bad else ""
    return ("fail" if bad else "pass"), figure


STEPS: tuple[Step, ...] = (
    Step("setup", "install ddpkit (and carried wheels) without a network; check its requirements import", 25, 90),
    Step(
        "env",
        "`ddpkit env --json`: devices, versions, the chosen backend",
        10,
        45,
        lambda ctx: ["-m", "ddpkit", "env", "--json"],
        None,
        _judge_env,
    ),
    Step(
        "tests",
        "`pytest -m cuda`: precisions and the scaler, channels_last, compile, the loaders, fsdp, DCP, "
        "evaluate, `ddpkit train` on digits (compiled), gpt and fast-cifar",
        150,
        210,
        _tests_argv,
        "tests",
        _judge_tests,
    ),
    Step(
        "parity",
        "ddpkit vs the hand-written loop on one GPU (resnet18, batch 512: steps of 5 ms or more), paired rounds",
        50,
        100,
        _parity_argv,
        "parity",
        _judge_parity,
        "benchmarks.parity",
    ),
    Step(
        "loader",
        "`ddpkit bench loader`: the resident loader against the DataLoader with pinned memory",
        30,
        90,
        lambda ctx: ctx.bench("loader", *(() if ctx.rehearsal else ("--repeats", "3"))),
        "loader",
        _judge_loader,
        "ddpkit.bench.loader",
    ),
    Step(
        "gpt",
        "`ddpkit bench gpt`: tokens/s and MFU at bf16 (153M parameters, 1024 tokens)",
        30,
        90,
        lambda ctx: ctx.bench("gpt"),
        "gpt",
        _judge_gpt,
        "ddpkit.bench.gpt",
    ),
    Step(
        "fast-cifar",
        "`ddpkit bench fast-cifar`: the recipe's 10 epochs of 50,000 synthetic CIFAR-shaped images",
        45,
        100,
        lambda ctx: ctx.bench("fast-cifar"),
        "fast-cifar",
        _judge_fast_cifar,
        "ddpkit.bench.fast_cifar",
    ),
    Step(
        "precision",
        "`ddpkit bench precision`: fp32/bf16/fp16 x channels_last, compile, cudnn.benchmark (resnet18)",
        120,
        150,
        lambda ctx: ctx.bench("precision", *(() if ctx.rehearsal else ("--repeats", "5"))),
        "precision",
        _judge_precision,
        "ddpkit.bench.precision",
    ),
)


# -- the command ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    steps = _select(parser, a.only)
    if a.prepare:
        return prepare(a.wheels)
    if a.replot:
        return replot(a.replot)
    if a.budget is not None and a.budget <= 0:
        parser.error(f"--budget must be positive, got {a.budget:g}")
    budget = a.budget or BUDGET_S * (REHEARSAL_SLACK if a.device == "cpu" else 1)
    if a.dry_run:
        print(plan_text(steps, budget))
        return 0
    cuda = _cuda_devices()
    if a.device == "cuda" and not cuda:
        why = f"no CUDA device is visible here ({_torch_word()})"
        print(f"{PROG}: {why}; nothing was run. On a GPU it would run:")
        print(plan_text(steps, budget))
        if a.results:  # asked for files (on a machine meant to have a GPU): say there why there are none
            ctx = Context("cuda", os.path.abspath(a.results), "")
            os.makedirs(ctx.results, exist_ok=True)
            write_report(ctx, [{"step": "env", "status": "fail", "figure": why, "seconds": 0.0}], 0.0, budget)
        return 0
    results = a.results or (tempfile.mkdtemp(prefix="ddpkit-gpu-rehearsal-") if a.device == "cpu" else None)
    results = results or os.path.join(ROOT, "benchmarks", "results")
    return check(steps, a.device, os.path.abspath(results), budget, os.path.abspath(a.wheels))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as every ddpkit command
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and each step's time budget; run nothing")
    p.add_argument(
        "--prepare",
        action="store_true",
        help=f"download the wheels the GPU image lacks ({', '.join(IMAGE_LACKS)}) into --wheels, for Python 3.12",
    )
    p.add_argument(
        "--replot",
        metavar="DIR",
        help="draw the plot of each result file in DIR beside it (NAME-cuda.png), from the JSON the check brought back",
    )
    p.add_argument(
        "--results",
        metavar="DIR",
        help="where the 8 result files go (default benchmarks/results/; with --device cpu a temporary folder)",
    )
    p.add_argument("--wheels", metavar="DIR", default=os.path.join(ROOT, WHEELS), help=f"default {WHEELS}/")
    p.add_argument(
        "--budget",
        type=float,
        help=f"seconds for the whole check (default {BUDGET_S:g}; {REHEARSAL_SLACK:g}x that with --device cpu)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu rehearses every step at smoke sizes, to check the check itself (default cuda)",
    )
    p.add_argument("--only", metavar="STEPS", help=f"comma-separated steps, of {','.join(s.name for s in STEPS)}")
    return p


def _select(parser: argparse.ArgumentParser, only: str | None) -> list[Step]:
    if not only:
        return list(STEPS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [s.name for s in STEPS]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(
            f"--only {only}: unknown step(s) {', '.join(unknown) or '(none named)'}; known: {', '.join(known)}"
        )
    return [s for s in STEPS if s.name in names]


def plan_text(steps: list[Step], budget: float) -> str:
    lines = [f"{'step':<11} {'estimate':>8} {'limit':>6}  what"]
    lines += [f"{s.name:<11} {s.estimate_s:>7.0f}s {s.limit_s:>5.0f}s  {s.what}" for s in steps]
    total = sum(s.estimate_s for s in steps)
    lines.append(
        f"{'total':<11} {total:>7.0f}s {budget:>5.0f}s  estimated on one H200, within the budget of {budget:g} s "
        "(a step that no longer fits is skipped)"
    )
    return "\n".join(lines)


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_word() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return f"torch {torch.__version__}, torch.cuda.is_available() is False"


# -- running --------------------------------------------------------------------------------------


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the check: the step running is stopped, the report written."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def check(steps: list[Step], device: str, results: str, budget: float, wheels: str) -> int:
    """Run `steps` within `budget` seconds, writing the report after each; 0 if every step
    passed, 1 if one failed, ran out of time or was skipped."""
    os.makedirs(results, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="ddpkit-gpu-check-")
    ctx = Context(device, results, scratch, env=_child_env())
    if ctx.rehearsal:
        ctx.env["DDPKIT_CUDA_TESTS_DEVICE"] = "cpu"  # tests/test_cuda.py's bodies, run on CPU
    else:
        ctx.env.pop("DDPKIT_CUDA_TESTS_DEVICE", None)  # a rehearsal's setting must not reach a GPU run
    for step in steps:  # an earlier run's file must not stand beside this run's report, nor be judged
        if step.result is not None and os.path.exists(ctx.out(step.result)):
            os.remove(ctx.out(step.result))
    print(f"{PROG}: {len(steps)} step(s) on {device}, budget {budget:g} s, results in {results}", flush=True)
    start = time.monotonic()
    outcomes: list[dict[str, Any]] = []
    slack = REHEARSAL_SLACK if ctx.rehearsal else 1.0
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    step = None
    try:
        for i, step in enumerate(steps, 1):
            left = budget - (time.monotonic() - start)
            if step.estimate_s * slack > left:
                outcome = {"step": step.name, "status": "skipped", "figure": f"no time left ({left:.0f} s)"}
                outcome["seconds"] = 0.0
            else:
                print(f"[{i}/{len(steps)}] {step.name}: {step.what} (about {step.estimate_s:.0f} s)", flush=True)
                outcome = run_step(step, ctx, min(step.limit_s * slack, left), wheels)
            outcomes.append(outcome)
            print(f"    {outcome['status']}: {outcome['figure']} ({outcome['seconds']:.1f} s)", flush=True)
            if outcome["status"] in ("fail", "timeout") and outcome.get("output_tail"):
                print(_indent(outcome["output_tail"][-1500:]), flush=True)
            write_report(ctx, outcomes, time.monotonic() - start, budget)  # what is done survives a kill
    except Interrupted as why:  # the step running was stopped with its session (run_limited)
        name = step.name if step is not None else "(before any step)"
        outcomes.append({"step": name, "status": "interrupted", "figure": f"{why} while it ran", "seconds": 0.0})
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    table = write_report(ctx, outcomes, time.monotonic() - start, budget)
    print("\n" + table, flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(o["status"] == "pass" for o in outcomes) else 1


def run_step(step: Step, ctx: Context, limit: float, wheels: str) -> dict[str, Any]:
    t = time.monotonic()
    if step.argv is None:
        status, figure, tail = setup(ctx, wheels, deadline=t + limit, install=not ctx.rehearsal)
        return {
            "step": step.name,
            "status": status,
            "figure": figure,
            "seconds": time.monotonic() - t,
            "output_tail": tail,
        }
    code, out, err = run_limited([sys.executable, *step.argv(ctx)], ctx.env, limit)
    tail = out + err
    outcome: dict[str, Any] = {"step": step.name, "returncode": code, "output_tail": tail[-OUTPUT_TAIL:]}
    try:
        if step.judge is None:
            outcome["status"], outcome["figure"] = ("pass" if code == 0 else "fail"), _last_line(tail)
        else:
            outcome["status"], outcome["figure"] = step.judge(_record(step, ctx, out), ctx)
        if code not in (0, None) and outcome["status"] == "pass":
            outcome["status"] = "fail"
    except Exception as err:  # noqa: BLE001 - one broken step must not end the check
        outcome["status"] = "fail"
        outcome["figure"] = f"no result ({type(err).__name__}: {str(err)[:200]})"
    if code is None:
        outcome["status"], outcome["figure"] = "timeout", f"stopped after {limit:.0f} s; {outcome['figure']}"
    elif code != 0 and (step.judge is None or outcome["figure"].startswith("no result")):
        outcome["figure"] = f"exited {code}: {_last_line(tail)}"
    elif code != 0:
        outcome["figure"] = f"exited {code}; {outcome['figure']}"
    outcome["seconds"] = time.monotonic() - t
    return outcome


def _record(step: Step, ctx: Context, stdout: str) -> dict[str, Any]:
    """What the step left to judge: its JSON file, the JSON it printed (env), or, for the
    tests, pytest's JUnit XML turned into tests-cuda.json."""
    if step.name == "env":
        record = json.loads(stdout)
        ctx.info["env"] = record
        return record
    if step.name == "tests":
        record = tests_record(os.path.join(ctx.scratch, "junit.xml"), ctx)
        _write_json(ctx.out("tests"), record)
        return record
    with open(ctx.out(step.result)) as f:
        return json.load(f)


GRACE_S = 10.0  # after a step's limit: SIGINT (pytest then still writes its JUnit XML), then SIGKILL


def run_limited(cmd: list[str], env: dict[str, str], limit: float) -> tuple[int | None, str, str]:
    """Run `cmd` from the repository root in a session of its own. At `limit` seconds the whole
    session (the launcher's workers too) gets SIGINT, and SIGKILL GRACE_S later; also when the
    check itself is interrupted. (exit code, or None when stopped at the limit; stdout; stderr)."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True
        )
        code: int | None = None
        try:
            code = proc.wait(timeout=max(1.0, limit - GRACE_S))
        except subprocess.TimeoutExpired:
            _signal_session(proc, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        finally:
            _signal_session(proc, signal.SIGKILL)  # whatever is left of the session: workers, their children
            proc.wait()
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a check started inside a launched job must start jobs of its own
    return env


# -- set-up ---------------------------------------------------------------------------------------


def setup(
    ctx: Context,
    wheels: str,
    site: str = os.path.join(ROOT, SITE),
    deadline: float | None = None,
    install: bool = True,
) -> tuple[str, str, str]:
    """Install the carried wheels (if any) into `site`, put it on the children's path, install
    ddpkit from this checkout if it is not importable from here (unless not `install`: a
    rehearsal changes nothing in the Python it runs on), and check that every requirement
    imports, all before `deadline` (time.monotonic()). (status, figure, output)."""
    deadline = deadline or time.monotonic() + 300

    def call(*args: str) -> tuple[int | None, str]:
        code, out, err = run_limited([sys.executable, *args], dict(ctx.env), max(1.0, deadline - time.monotonic()))
        return code, out + err

    pip = ("-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps")
    log: list[str] = []
    carried = (
        sorted(os.path.join(wheels, n) for n in os.listdir(wheels) if n.endswith(".whl"))
        if os.path.isdir(wheels)
        else []
    )
    if carried:
        code, out = call(*pip, "--no-index", "--no-compile", "--upgrade", "--target", site, *carried)
        log.append(f"wheels from {wheels} into {site}: exit {code}\n{out[-1000:]}")
        path = ctx.env.get("PYTHONPATH")
        ctx.env["PYTHONPATH"] = site + (os.pathsep + path if path else "")
    here = os.path.join(ROOT, "src", "ddpkit")
    where = _ddpkit_location(call)
    installed = where == here
    if not installed and install:
        code, out = call(*pip, "--no-build-isolation", "-e", ROOT)
        log.append(
            f"pip install --no-deps --no-build-isolation -e . (ddpkit was at {where}): exit {code}\n{out[-1500:]}"
        )
        where = _ddpkit_location(call)
        installed = where == here
        if not installed:  # the rest can still run on this checkout's sources: a failed step, not a lost window
            src = os.path.join(ROOT, "src")
            ctx.env["PYTHONPATH"] = os.pathsep.join(p for p in (src, ctx.env.get("PYTHONPATH")) if p)
            where = _ddpkit_location(call)
    probe = _probe_requirements(call)
    ctx.info["setup"] = {"ddpkit_at": where, "python": platform.python_version(), **probe}
    missing = probe.get("missing", [])
    if installed:
        figure = "ddpkit installed from this checkout"
    elif where == here:
        figure = "ddpkit NOT installed (pip install -e . failed: see the log); its steps run from src/ on PYTHONPATH"
    else:
        figure = f"ddpkit NOT importable from this checkout (it is at {where})"
    figure += f"; Python {platform.python_version()}, torch {probe.get('torch', '?')}"
    if missing:
        figure += f"; missing: {', '.join(missing)} (carry them: {PROG} --prepare)"
    notes = _torch_notes(probe.get("torch"))
    if notes:
        figure += "; " + notes
    return ("pass" if installed and not missing else "fail"), figure, "\n".join(log)


def _ddpkit_location(call: Callable[..., tuple[int | None, str]]) -> str | None:
    code, out = call("-c", "import os, ddpkit; print(os.path.dirname(os.path.abspath(ddpkit.__file__)))")
    return out.strip().splitlines()[-1] if code == 0 and out.strip() else None


PROBE = """
import importlib, importlib.metadata as md, json, re
names = {"scikit-learn": "sklearn", "pyyaml": "yaml", "simple-parsing": "simple_parsing"}
out = {"missing": [], "versions": {}}
try:
    reqs = [r for r in md.requires("ddpkit") or [] if "extra ==" not in r]
except md.PackageNotFoundError:  # not installed (imported from src/): the project's own list
    import tomllib
    with open("pyproject.toml", "rb") as f:
        reqs = tomllib.load(f)["project"]["dependencies"]
for req in reqs:
    dist = re.split(r"[<>=!~; \\[]", req, maxsplit=1)[0].strip()
    try:
        importlib.import_module(names.get(dist.lower(), dist.replace("-", "_")))
        out["versions"][dist] = md.version(dist)
    except Exception as err:
        out["missing"].append(dist)
import torch
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
print(json.dumps(out))
"""


def _probe_requirements(call: Callable[..., tuple[int | None, str]]) -> dict[str, Any]:
    code, out = call("-c", PROBE)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"missing": ["(the probe failed)"], "probe_output": out[-1000:]}


def _torch_notes(version: str | None) -> str:
    """What ddpkit, written against torch 2.13, says of an older torch (a line, not a failure)."""
    if not version:
        return ""
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 13):
        return ""
    return f"torch {version} is older than the 2.13 ddpkit is developed on: a step that needs 2.13 fails alone"


def prepare(wheels: str) -> int:
    """Download, with this machine's network, the wheels of IMAGE_LACKS for the GPU machine's
    Python 3.12, at the versions installed here (the ones the tests ran with)."""
    from importlib import metadata

    os.makedirs(wheels, exist_ok=True)
    specs = []
    for name in IMAGE_LACKS:
        try:
            specs.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            specs.append(name)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *WHEEL_PLATFORM]
    code = subprocess.call([*cmd, "-d", wheels, *specs])
    if code != 0:
        print(f"{PROG} --prepare: pip download failed (exit {code})", file=sys.stderr)
        return 1
    print(f"{PROG} --prepare: {', '.join(specs)} in {wheels}/; on the GPU machine carry that folder and run:")
    print(f"  {PROG} --results DIR")
    return 0


def replot(folder: str) -> int:
    """Draw each step's plot from its result file in `folder`: the check draws none on the GPU
    machine, whose output is limited to 8 files."""
    import importlib

    drawn = 0
    for step in STEPS:
        for suffix in ("cuda", "cpu-rehearsal"):
            path = os.path.join(folder, f"{step.result}-{suffix}.json")
            if step.plots is None or not os.path.isfile(path):
                continue
            with open(path) as f:
                record = json.load(f)
            png = os.path.splitext(path)[0] + ".png"
            importlib.import_module(step.plots).plot(record, png)
            print(png)
            drawn += 1
    if not drawn:
        print(f"{PROG} --replot {folder}: no result file of the check there", file=sys.stderr)
        return 2
    return 0


# -- the report -----------------------------------------------------------------------------------


def tests_record(junit: str, ctx: Context) -> dict[str, Any]:
    """pytest's JUnit XML as a record: each test's outcome, seconds and message."""
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or "") + ("\n" + (node.text or "")[-1500:] if kind != "skipped" else "")
                break
        tests.append(
            {
                "name": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message.strip(),
            }
        )
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "skipped")}
    counts["failed"] = sum(t["outcome"] == "failed" for t in tests)
    counts["errors"] = sum(t["outcome"] == "error" for t in tests)
    return {"benchmark": "tests", **_where(ctx), "counts": counts, "tests": tests}


def _where(ctx: Context) -> dict[str, Any]:
    """Hardware, versions and date, from `ddpkit env --json` (the env step) and this process."""
    env = ctx.info.get("env", {})
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": ctx.device,
        "rehearsal": ctx.rehearsal,
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "env": env,
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def write_report(ctx: Context, outcomes: list[dict[str, Any]], seconds: float, budget: float) -> str:
    """gpu-check-*.json (everything) and SUMMARY-gpu*.md (the table); returns the table."""
    suffix = "cuda" if not ctx.rehearsal else "cpu-rehearsal"
    table = summary_table(outcomes, seconds, budget, ctx)
    _write_json(
        os.path.join(ctx.results, f"gpu-check-{suffix}.json"),
        {
            "benchmark": "gpu-check",
            **_where(ctx),
            "setup": ctx.info.get("setup"),
            "steps": outcomes,
            "seconds": seconds,
        },
    )
    with open(os.path.join(ctx.results, f"SUMMARY-gpu-{suffix}.md"), "w") as f:
        f.write(table + "\n")
    return table


def summary_table(outcomes: list[dict[str, Any]], seconds: float, budget: float, ctx: Context) -> str:
    where = _gpu_names(ctx.info.get("env", {})) or ctx.device
    setup = ctx.info.get("setup") or {}
    head = (
        f"`{PROG}` on {time.strftime('%Y-%m-%d')}: {where}; torch {setup.get('torch', '?')} (CUDA "
        f"{setup.get('cuda') or '-'}), Python {platform.python_version()}, commit {_git_commit() or '?'}; "
        f"{seconds:.0f} s of a {budget:g} s budget"
        + (" (a REHEARSAL on CPU, not a GPU result)" if ctx.rehearsal else "")
    )
    lines = [head, "", "| check | result | seconds | figure |", "|---|---|---|---|"]
    for o in outcomes:
        figure = str(o["figure"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {o['step']} | {o['status']} | {o['seconds']:.1f} | {figure} |")
    return "\n".join(lines)


def _write_json(path: str, record: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, path)


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.rstrip().splitlines())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


if __name__ == "__main__":
    sys.exit(main())
