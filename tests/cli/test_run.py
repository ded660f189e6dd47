"""`ddpkit run`: scripts written for torchrun, launched through torch's elastic agent."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.cli

TORCHRUN_SCRIPT = """
    import sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")  # env:// from the launcher: RANK, WORLD_SIZE, MASTER_ADDR, ...
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g} args {sys.argv[1:]}", flush=True)
    if "--fail" in sys.argv and dist.get_rank() == 1:
        raise RuntimeError("rank one gives up")
    dist.destroy_process_group()
"""

RUNTIME_SCRIPT = """
    import torch, ddpkit
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        total = rt.all_reduce(float(rt.rank))
        rt.print(f"world {rt.world_size} total {total:g}")
"""


@pytest.fixture
def script(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def test_runs_a_torchrun_script_with_rank_prefixes(script):
    proc = run_cli("run", "--nproc", "3", script(TORCHRUN_SCRIPT), "x", "--y")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank{r}]: rank {r} of 3 sum 6 args ['x', '--y']" for r in range(3)]


def test_rank0_only_output(script):
    proc = run_cli("run", "--nproc", "2", "--rank0-only", script(TORCHRUN_SCRIPT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank0]: rank 0 of 2 sum 3" in proc.stdout and "rank 1 of 2" not in proc.stdout


def test_runs_a_ddpkit_runtime_script(script):
    proc = run_cli("run", "--nproc", "2", script(RUNTIME_SCRIPT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("world 2 total 1") == 1  # rt.print: rank 0 only


def test_failing_script_names_the_rank(script):
    proc = run_cli("run", "--nproc", "2", script(TORCHRUN_SCRIPT), "--fail")
    assert proc.returncode == 1
    assert "rank one gives up" in proc.stderr  # the worker's own traceback is shown
    assert proc.stderr.strip().splitlines()[-1].startswith("ddpkit run: rank 1 on ")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["nosuch.py"], "nosuch.py"),
        (["--nnodes", "2", "{S}"], "--master-addr"),
        (["--nnodes", "3:2", "{S}"], "--nnodes"),
        (["--nproc", "0", "{S}"], "--nproc"),
        (["--max-restarts", "-1", "{S}"], "--max-restarts"),
    ],
)
def test_bad_input(script, args, needle):
    path = script(TORCHRUN_SCRIPT)
    proc = run_cli("run", *[a.replace("{S}", path) for a in args])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
