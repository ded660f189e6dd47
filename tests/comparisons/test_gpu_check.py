"""`python -m benchmarks gpu`, the GPU check, on a machine without a GPU: it says so and lists its
plan; its plan fits 8 minutes; its steps run under their limits (their workers killed with
them), are judged, and reported in at most 8 files; carried wheels reach the steps; and the CUDA
tests it runs are themselves rehearsed on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from benchmarks import gpu
from tests.conftest import ROOT, clean_env, run_comparison

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the command does without a GPU")


@pytest.mark.unit
def test_the_plan_fits_eight_minutes_and_every_step_fits_its_limit():
    assert sum(s.estimate_s for s in gpu.STEPS) <= gpu.BUDGET_S == 480
    assert all(0 < s.estimate_s <= s.limit_s for s in gpu.STEPS)
    assert [s.name for s in gpu.STEPS][:3] == ["setup", "env", "tests"]  # correctness before figures
    # at most 8 files come back from the GPU machine: one per step that writes one, and two of the check's own
    assert sum(s.result is not None for s in gpu.STEPS) + 2 <= 8


@pytest.mark.cli
@NO_GPU
def test_without_a_gpu_it_says_so_in_one_line_lists_its_plan_and_exits_0():
    results = os.path.join(ROOT, "benchmarks", "results")
    before = sorted(os.listdir(results))
    proc = run_comparison("gpu")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "no CUDA device is visible" in lines[0] and proc.stderr == ""
    for step in gpu.STEPS:
        assert any(line.split()[:1] == [step.name] for line in lines[1:]), step.name
    assert sorted(os.listdir(results)) == before  # nothing measured, nothing written


@pytest.mark.cli
def test_dry_run_shows_each_steps_time_budget():
    proc = run_comparison("gpu", "--dry-run", "--only", "tests,gpt")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:3] for line in proc.stdout.splitlines()[1:]}
    by = {s.name: s for s in gpu.STEPS}
    for name in ("tests", "gpt"):
        assert rows[name] == [f"{by[name].estimate_s:.0f}s", f"{by[name].limit_s:.0f}s"]
    assert rows["total"] == [f"{by['tests'].estimate_s + by['gpt'].estimate_s:.0f}s", "480s"]
    assert set(rows) == {"tests", "gpt", "total"}


@pytest.mark.cli
@pytest.mark.parametrize(
    "args,says",
    [
        (["--only", "tests,nope"], "unknown step(s) nope"),
        (["--budget", "0"], "--budget must be positive"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--replot", "/nonexistent"], "no result file of the check there"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, says):
    proc = run_comparison("gpu", *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr and proc.stdout == ""


def _step(name: str, code: str, estimate: float = 1, limit: float = 30) -> gpu.Step:
    return gpu.Step(name, f"the {name} step", estimate, limit, lambda ctx: ["-c", code], None, None)


@pytest.mark.cli
def test_steps_run_under_their_limits_and_a_late_one_is_skipped(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    hangs = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    results = tmp_path / "results"
    results.mkdir()
    (results / "stale-cpu-rehearsal.json").write_text("{}")  # an earlier run's, which this run never rewrites
    judged = gpu.Step(
        "stale", "writes nothing", 1, 30, lambda ctx: ["-c", "pass"], "stale", lambda r, c: ("pass", "ok")
    )
    steps = [
        judged,
        _step("hangs", hangs, limit=1),
        _step("fails", "import sys; print('first'); print('what went wrong'); sys.exit(3)"),
        _step("passes", "print('fine')"),
        _step("late", "print('never')", estimate=1000),
    ]
    t = time.monotonic()
    code = gpu.check(steps, "cpu", str(results), 60, str(tmp_path / "no-wheels"))
    assert time.monotonic() - t < 30 and code == 1
    report = json.loads((tmp_path / "results" / "gpu-check-cpu-rehearsal.json").read_text())
    by = {s["step"]: s for s in report["steps"]}
    assert by["hangs"]["status"] == "timeout" and by["hangs"]["seconds"] < 10
    assert by["fails"]["status"] == "fail" and by["fails"]["figure"] == "exited 3: what went wrong"
    assert by["passes"]["status"] == "pass" and by["late"]["status"] == "skipped"
    assert by["stale"]["status"] == "fail" and by["stale"]["figure"].startswith("no result (FileNotFoundError")
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in open(f"/proc/{grandchild}/stat").read().split()[2]
    table = (tmp_path / "results" / "SUMMARY-gpu-cpu-rehearsal.md").read_text()
    assert "| hangs | timeout |" in table and "| late | skipped |" in table and "REHEARSAL" in table


@pytest.mark.cli
def test_a_check_stopped_from_outside_stops_its_step_and_still_reports(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    script = (
        "import sys; from benchmarks import gpu; "
        "hangs = gpu.Step('hangs', 'hangs', 1, 60, lambda ctx: ['-c', sys.argv[1]]); "
        "done = gpu.Step('done', 'passes', 1, 60, lambda ctx: ['-c', 'pass']); "
        "sys.exit(gpu.check([done, hangs], 'cpu', sys.argv[2], 600, 'no-wheels'))"
    )
    hang = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, hang, str(tmp_path / "r")], cwd=ROOT, env=clean_env())
    for _ in range(300):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    proc.terminate()
    assert proc.wait(timeout=30) == 1
    report = json.loads((tmp_path / "r" / "gpu-check-cpu-rehearsal.json").read_text())
    assert [(s["step"], s["status"]) for s in report["steps"]] == [("done", "pass"), ("hangs", "interrupted")]
    assert report["steps"][1]["figure"] == "SIGTERM while it ran"
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in open(f"/proc/{grandchild}/stat").read().split()[2]


@pytest.mark.cli
def test_the_tests_record_counts_pytest_outcomes(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_broken(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_elsewhere(): pass\n"
    )
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "test_three.py"],
        cwd=tmp_path,
        capture_output=True,
        env=clean_env(),
    )
    ctx = gpu.Context("cpu", str(tmp_path), str(tmp_path))
    record = gpu.tests_record(str(junit), ctx)
    assert record["counts"] == {"passed": 1, "skipped": 1, "failed": 1, "errors": 0}
    broken = next(t for t in record["tests"] if t["name"].endswith("test_broken"))
    assert broken["outcome"] == "failed" and "assert 1 == 2" in broken["message"]
    status, figure = gpu._judge_tests(record, ctx)
    assert status == "fail" and figure.startswith("1 passed, 1 failed, 0 errors, 1 skipped: ")


def _wheel(folder, name: str = "carried_pkg", version: str = "0.1") -> None:
    """A real (pure-Python) wheel, as pip download brings one."""
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "CARRIED = True\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


@pytest.mark.cli
def test_setup_installs_carried_wheels_where_the_steps_import_them(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    ctx = gpu.Context("cpu", str(tmp_path), str(tmp_path), env=gpu._child_env())
    # install=False: a test never reinstalls ddpkit into the Python that runs it
    status, figure, log = gpu.setup(ctx, str(wheels), site=str(tmp_path / "site"), install=False)
    assert status == "pass", (figure, log)  # (run from the checkout ddpkit is installed from, as CI does)
    assert figure.startswith("ddpkit installed from this checkout;") and "missing" not in figure
    assert ctx.info["setup"]["versions"]["simple-parsing"]  # every requirement of ddpkit imported
    probe = subprocess.run([sys.executable, "-c", "import carried_pkg; print(carried_pkg.CARRIED)"], env=ctx.env)
    assert probe.returncode == 0


@pytest.mark.cli
def test_when_the_editable_install_fails_the_steps_still_run_from_src(tmp_path, monkeypatch):
    real_run, real_location = gpu.run_limited, gpu._ddpkit_location
    tried = []

    def run(cmd, env, limit):
        if "-e" in cmd:  # pip install --no-deps --no-build-isolation -e . (an old setuptools, say)
            tried.append(cmd)
            return 1, "", "ERROR: simulated: the build backend is missing"
        return real_run(cmd, env, limit)

    looks = []

    def location(call):  # not importable before the install, nor after the failed one; then as it is
        looks.append(call)
        return None if len(looks) <= 2 else real_location(call)

    monkeypatch.setattr(gpu, "run_limited", run)
    monkeypatch.setattr(gpu, "_ddpkit_location", location)
    ctx = gpu.Context("cpu", str(tmp_path), str(tmp_path), env=gpu._child_env())
    status, figure, log = gpu.setup(ctx, str(tmp_path / "no-wheels"))
    assert tried and status == "fail" and "simulated" in log
    assert figure.startswith("ddpkit NOT installed (pip install -e . failed: see the log); its steps run from src/")
    assert ctx.env["PYTHONPATH"].split(os.pathsep)[0] == os.path.join(ROOT, "src")
    assert ctx.info["setup"]["ddpkit_at"] == os.path.join(ROOT, "src", "ddpkit")


@pytest.mark.cli
def test_a_rehearsal_runs_the_steps_and_writes_at_most_eight_files(tmp_path):
    results = tmp_path / "results"
    proc = run_comparison("gpu", "--device", "cpu", "--only", "setup,env,gpt", "--results", str(results))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(os.listdir(results)) == [
        "SUMMARY-gpu-cpu-rehearsal.md",
        "gpt-cpu-rehearsal.json",
        "gpu-check-cpu-rehearsal.json",
    ]
    report = json.loads((results / "gpu-check-cpu-rehearsal.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["pass"] * 3
    assert report["env"]["torch"]["version"] == torch.__version__  # where it ran, from `ddpkit env`
    gpt = json.loads((results / "gpt-cpu-rehearsal.json").read_text())
    assert gpt["versions"]["torch"] == torch.__version__ and gpt["result"]["tokens_per_second"]["median"] > 0
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| gpt | pass |")
    replot = run_comparison("gpu", "--replot", str(results))  # the plots the GPU machine does not keep
    assert replot.returncode == 0 and replot.stdout.split() == [str(results / "gpt-cpu-rehearsal.png")]
    assert (results / "gpt-cpu-rehearsal.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.cli
def test_the_fast_cuda_tests_pass_when_rehearsed_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda and unit", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**clean_env(), "DDPKIT_CUDA_TESTS_DEVICE": "cpu"},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "passed" in last and "failed" not in last and "skipped" not in last
