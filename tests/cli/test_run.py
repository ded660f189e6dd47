"""`ddpkit run`: scripts written for torchrun, launched through torch's elastic agent, from any
torchrun command line with `torchrun` replaced by `ddpkit run`."""

from __future__ import annotations

import argparse
import re
import subprocess
import textwrap

import pytest

from ddpkit.cli import run as run_command
from ddpkit.errors import UsageError
from tests.cli.argv_runner import run_batch
from tests.cli.helpers import free_port
from tests.conftest import run_cli, start_cli

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


@pytest.fixture
def script(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


@pytest.mark.cli
def test_runs_a_torchrun_script_from_torchruns_standalone_command_line_with_rank_prefixes(script):
    # torchrun's own spelling (--standalone --nproc_per_node), each rank's line prefixed
    proc = run_cli("run", "--standalone", "--nproc_per_node=3", script(TORCHRUN_SCRIPT), "x", "--y")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank{r}]: rank {r} of 3 sum 6 args ['x', '--y']" for r in range(3)]


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> subprocess.CompletedProcess:
    """`ddpkit run --nproc 2 SCRIPT --fail`, whose rank 1 raises: one run for the two tests of
    what it prints."""
    path = tmp_path_factory.mktemp("failed") / "script.py"
    path.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    return run_cli("run", "--nproc", "2", str(path), "--fail")


@pytest.mark.cli
def test_failing_script_names_the_rank(failed):
    proc = failed  # --nproc 2 SCRIPT --fail
    assert proc.returncode == 1
    assert "rank one gives up" in proc.stderr  # the worker's own traceback is shown
    assert re.match(r"ddpkit run: rank 1 (\(pid \d+\) )?on ", proc.stderr.strip().splitlines()[-1])


BAD_INPUT = [
    (["nosuch.py"], "nosuch.py"),
    (["--nnodes", "2", "{S}"], "--master-addr"),
    (["--nnodes", "3:2", "{S}"], "--nnodes"),
    (["--nproc", "0", "{S}"], "--nproc"),
    (["--max-restarts", "-1", "{S}"], "--max-restarts"),
    # refused in this process, before any worker starts (a missing module was exit 1 after them)
    (["-m", "missing_module"], "-m missing_module: no such module"),
    (["--no-python", "no-such-program-here"], "--no-python no-such-program-here"),
    (["--no-python", "-m", "json.tool"], "--no-python"),
    # ports outside 1..65535 were an OverflowError traceback
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "70000", "{S}"], "--master-port"),
    (["--master_port", "-1", "{S}"], "--master-port"),
    (["--node-rank", "-1", "{S}"], "--node-rank"),
    (["--rdzv-endpoint", "localhost:99999", "{S}"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0", "{S}"], "--rdzv-endpoint"),
    (["--rdzv-backend", "etcd", "{S}"], "--rdzv-backend etcd"),
    (["--rdzv-conf", "store_type=file", "{S}"], "--rdzv-conf store_type"),
    (["--standalone", "--nnodes", "2", "{S}"], "--standalone"),
    (["--local-ranks-filter", "first", "{S}"], "--local-ranks-filter"),
    (["--redirects", "9", "{S}"], "--redirects"),
    (["--start-method", "thread", "{S}"], "--start-method"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[dict]:
    """Each BAD_INPUT command line with {S} a script that would run, in a folder of its own with
    a --log-dir there, run in one helper interpreter (tests/cli/argv_runner.py: they are all
    refused before any worker starts): their outcomes and log folders, in order."""
    cases = []
    for i, (args, _) in enumerate(BAD_INPUT):
        root = tmp_path_factory.mktemp(f"bad{i}")
        path = root / "script.py"
        path.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
        logs = root / "logs"
        argv = ["run", "--log-dir", str(logs), *[a.replace("{S}", str(path)) for a in args]]
        cases.append({"argv": argv, "cwd": str(root), "logs": logs})
    outcomes = run_batch([{"argv": c["argv"], "cwd": c["cwd"]} for c in cases])
    return [{**c, **r} for c, r in zip(cases, outcomes)]


@pytest.mark.cli
@pytest.mark.parametrize("args,needle", BAD_INPUT)
def test_bad_input(refused, args, needle):
    r = refused[BAD_INPUT.index((args, needle))]
    assert r["code"] == 2, r["stderr"][-2000:]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r["stderr"]
    assert not r["logs"].exists() and r["stdout"] == ""  # nothing written, nothing started


# -- torchrun's command line ----------------------------------------------------------------------

# A value each of torchrun's options accepts (by its `dest`): an option torch adds has none, and
# the test below fails until ddpkit decides what that option does under `ddpkit run`.
TORCHRUN_VALUES = {
    "nnodes": "1:1",
    "nproc_per_node": "2",
    "rdzv_backend": "static",
    "rdzv_endpoint": "localhost:29400",
    "rdzv_id": "job7",
    "rdzv_conf": "join_timeout=30,is_host=1",
    "max_restarts": "1",
    "monitor_interval": "5",
    "start_method": "fork",
    "event_log_handler": "console",
    "role": "trainer",
    "log_dir": "{TMP}/logs",
    "redirects": "0:3,1:1",
    "tee": "3",
    "local_ranks_filter": "0,1",
    "duplicate_stdout_filters": "loss,acc",
    "duplicate_stderr_filters": "error",
    "node_rank": "0",
    "master_addr": "127.0.0.1",
    "master_port": "29500",
    "local_addr": "127.0.0.1",
    "logs_specs": "default",
    "numa_binding": "node",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "30",
}


def _torchrun_options() -> list[tuple[str, argparse.Action]]:
    from torch.distributed.run import get_args_parser

    return [
        (opt, act) for act in get_args_parser()._actions for opt in act.option_strings if opt not in ("-h", "--help")
    ]


def _settings(*argv: str):
    return run_command.settings(run_command._parser().parse_args([*argv, "train.py"]))


@pytest.mark.unit
@pytest.mark.parametrize("option,action", _torchrun_options(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_torchrun_option_is_accepted(option, action, tmp_path):
    ours = run_command._parser()._option_string_actions.get(option)
    assert ours is not None, f"ddpkit run does not accept torchrun's {option}"
    assert (ours.nargs == 0) == (action.nargs == 0), f"{option} takes a value in one parser only"
    if action.nargs == 0:
        argv = [option]
    else:
        assert action.dest in TORCHRUN_VALUES, f"torchrun has a new option {option}: decide what it does here"
        argv = [option, TORCHRUN_VALUES[action.dest].replace("{TMP}", str(tmp_path))]
    if action.type is not None and action.nargs != 0:
        action.type(argv[1])  # the sample value is one torchrun takes too
    _settings(*argv)  # parsed, and no usage error


@pytest.mark.unit
def test_torchrun_options_mean_what_they_mean_there(tmp_path):
    a = run_command._parser().parse_args(["--nproc_per_node=3", "--max_restarts", "2", "x.py", "--lr", "1"])
    assert (a.nproc, a.max_restarts, a.script, a.args) == ("3", 2, "x.py", ["--lr", "1"])
    nodes, kwargs = _settings(
        "--nnodes=2",
        "--rdzv-backend=static",
        "--node_rank=0",
        "--rdzv-endpoint=127.0.0.1:29577",
        "--rdzv_id=job7",
        "--rdzv-conf=join_timeout=30",
        "--local-addr=127.0.0.1",
    )
    assert (nodes.nnodes, nodes.master_addr, nodes.master_port, nodes.run_id) == ("2", "127.0.0.1", 29577, "job7")
    rendezvous = nodes.rendezvous()
    assert rendezvous["rdzv_configs"] == {"join_timeout": 30, "is_host": True}  # static: node 0 hosts
    assert rendezvous["run_id"] == "job7" and rendezvous["local_addr"] == "127.0.0.1"
    # c10d's default port for an endpoint without one; IPv6 in brackets; the endpoint wins over
    # --master-addr, as in torchrun; --standalone ignores the rendezvous options, as in torchrun.
    assert _settings("--rdzv-endpoint", "10.0.0.1")[0].master_port == 29400
    ipv6 = _settings("--rdzv-endpoint", "[::1]:7")[0]
    assert (ipv6.master_addr, ipv6.master_port) == ("::1", 7)
    assert _settings("--master-addr", "10.0.0.9", "--rdzv-endpoint", "10.0.0.1:5")[0].master_addr == "10.0.0.1"
    assert _settings("--standalone", "--rdzv-endpoint", "10.0.0.1:5")[0].master_addr is None
    assert kwargs == {"module": False, "no_python": False, "log_dir": None, "show_ranks": None}


@pytest.mark.unit
def test_output_options(tmp_path):
    assert _settings("--rank0-only")[1]["show_ranks"] == {0}
    assert _settings("--local-ranks-filter", "1,2")[1]["show_ranks"] == {1, 2}
    assert _settings("--local_ranks_filter", "")[1]["show_ranks"] is None  # torchrun's default: all
    assert _settings("--rank0-only", "--local-ranks-filter", "0,1")[1]["show_ranks"] == {0}
    logs = str(tmp_path / "logs")
    kwargs = _settings("--log_dir", logs, "--no-python")[1]
    assert (kwargs["log_dir"], kwargs["no_python"], kwargs["module"]) == (logs, True, False)
    with pytest.raises(UsageError, match="--log-dir"):
        _settings("--log-dir", __file__)


PACKAGE_MODULE = """
    import os, sys
    print(f"module rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}", flush=True)
"""


@pytest.mark.cli
def test_torchrun_c10d_command_line_with_a_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(textwrap.dedent(PACKAGE_MODULE))
    argv = ["--nnodes=1", "--nproc-per-node", "2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}"]
    proc = run_cli("run", *argv, "-m", "pkg.mod", "--y", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("[rank"))
    assert lines == [f"[rank{r}]: module rank {r} of 2 args ['--y']" for r in range(2)]


@pytest.mark.cli
def test_no_python_log_dir_and_local_ranks_filter(tmp_path):
    program = tmp_path / "hello.sh"
    program.write_text('#!/bin/sh\necho "local rank $LOCAL_RANK of $WORLD_SIZE says $1"\n')
    program.chmod(0o755)
    logs = tmp_path / "logs"
    argv = ["--nproc", "2", "--no_python", "--log-dir", str(logs), "--local-ranks-filter", "1", str(program), "hi"]
    proc = run_cli("run", *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "local rank 1 of 2 says hi" in proc.stdout and "local rank 0" not in proc.stdout
    kept = "".join(p.read_text() for p in logs.rglob("stdout.log"))  # rank 0's output is kept there
    assert "local rank 0 of 2 says hi" in kept


@pytest.mark.cli
def test_rank0_only_shows_rank_0_and_keeps_the_other_ranks_output_in_the_log_dir(script, tmp_path):
    logs = tmp_path / "logs"
    proc = run_cli("run", "--nproc", "2", "--rank0-only", "--log-dir", str(logs), script(TORCHRUN_SCRIPT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank0]: rank 0 of 2 sum 3" in proc.stdout and "rank 1 of 2" not in proc.stdout
    assert "rank 1 of 2 sum 3" in "".join(p.read_text() for p in logs.rglob("stdout.log"))


NODE_SCRIPT = """
    import os
    print(f"node {os.environ['GROUP_RANK']} launcher {os.getppid()}", flush=True)
"""


@pytest.mark.cli
@pytest.mark.slow
def test_two_nodes_on_one_host_take_node_ranks_in_launcher_pid_order(script):
    # What docs/launching.md says: c10d orders nodes by address, then by their launcher's pid;
    # --node-rank only picks the node that hosts the rendezvous (torchrun's c10d does the same;
    # only its static backend follows --node-rank). Here the node given --node-rank 1 starts first.
    path, port = script(NODE_SCRIPT), free_port()
    procs = []
    for node_rank in (1, 0):
        argv = ["--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd = ["run", *argv, "--node-rank", str(node_rank), path]
        procs.append(start_cli(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = {}
    for p, (out, _) in zip(procs, outs):
        node, launcher = out.split("node ")[1].split()[0], int(out.split("launcher ")[1].split()[0])
        assert launcher == p.pid
        seen[node] = launcher
    assert seen["0"] == min(p.pid for p in procs) and set(seen) == {"0", "1"}


FAULTY_SCRIPT = """
    import os, signal, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print("before a blank line")
    print()
    if "--kill" in sys.argv and rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if "--hang" in sys.argv and rank == 1:
        def stuck_in_forward():
            time.sleep(600)
        stuck_in_forward()
    if "--freeze" in sys.argv and rank == 1:
        def frozen_in_forward():
            os.kill(os.getpid(), signal.SIGSTOP)
        frozen_in_forward()
    if "--term" in sys.argv and rank == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    dist.barrier()
    print(f"attempt {attempt} done", flush=True)
"""


@pytest.mark.cli
def test_the_console_has_one_prefix_per_line_and_none_on_blank_lines(script):
    proc = run_cli("run", "--nproc", "2", script(FAULTY_SCRIPT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines.count("") == 2 and not any(line.strip() in ("[rank0]:", "[rank1]:") for line in lines)
    assert sorted(line for line in lines if "done" in line) == ["[rank0]: attempt 0 done", "[rank1]: attempt 0 done"]


@pytest.mark.cli
def test_a_traceback_gets_one_prefix_and_no_launcher_frames(failed):
    proc = failed  # --nproc 2 SCRIPT --fail
    assert proc.returncode == 1
    assert "[rank1]: Traceback" in proc.stderr and "[rank1]: [rank1]:" not in proc.stderr
    assert "runpy" not in proc.stderr and "ddpkit/launcher" not in proc.stderr


@pytest.mark.cli
def test_a_sigkilled_rank_is_named_and_its_restart_says_so(script):
    proc = run_cli("run", "--nproc", "2", "--max-restarts", "1", script(FAULTY_SCRIPT), "--kill")
    assert proc.returncode == 0, proc.stderr[-2000:]
    restarts = [line for line in proc.stderr.splitlines() if "restart" in line]
    assert len(restarts) == 1, proc.stderr
    assert re.search(r"restart 1 of 1: rank 1 \(pid \d+\) was killed by SIGKILL \(out of memory\?\)", restarts[0])
    assert "[rank0]: attempt 1 done" in proc.stdout and "attempt 0 done" not in proc.stdout


@pytest.mark.cli
def test_a_sigkilled_rank_without_restarts_is_the_one_blamed(script):
    proc = run_cli("run", "--nproc", "2", script(FAULTY_SCRIPT), "--kill")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"ddpkit run: rank 1 \(pid \d+\) on \S+ was killed by SIGKILL \(out of memory\?\)", last), last


@pytest.mark.cli
def test_a_hung_rank_is_named_with_its_stack(script):
    proc = run_cli("run", "--nproc", "2", script(FAULTY_SCRIPT), "--hang", timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"ddpkit run: rank 1 \(pid \d+\) on \S+ hung: it never reached the collective", last), last
    assert "Stack of rank 1 when it was stopped" in proc.stderr and "in stuck_in_forward" in proc.stderr


@pytest.mark.cli
def test_a_frozen_rank_is_named_as_hung_with_its_stack(script):
    proc = run_cli("run", "--nproc", "2", script(FAULTY_SCRIPT), "--freeze", timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ddpkit run: rank 1 \(pid \d+\) on \S+ hung: it was stopped by SIGSTOP and never continued, until rank 0 "
        r"gave up waiting for it \(.*Timed out waiting 3000ms.*\); its stack is above",
        last,
    ), last
    # its stack, dumped as it resumes to take the SIGTERM: in frozen_in_forward, or a moment after
    assert "Stack of rank 1 when it was stopped" in proc.stderr and 'script.py", line' in proc.stderr
    assert re.search(r"ddpkit: rank 1 \(pid \d+\) was stopped by SIGSTOP: its peers wait", proc.stderr)


@pytest.mark.cli
@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_rank_sigtermed_from_outside_is_named_with_the_signal(script, restarts):
    proc = run_cli("run", "--nproc", "2", "--max-restarts", restarts, script(FAULTY_SCRIPT), "--term")
    said = r"was killed by SIGTERM \(not from the launcher: kill, a scheduler\?\)"
    if restarts == "0":
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"ddpkit run: rank 1 \(pid \d+\) on \S+ {said}", last), last
    else:  # the restart goes on without the signal: its line says why it was needed
        assert proc.returncode == 0, proc.stderr[-2000:]
        restarted = [line for line in proc.stderr.splitlines() if "restart" in line]
        assert len(restarted) == 1 and re.search(rf"restart 1 of 1: rank 1 \(pid \d+\) {said}$", restarted[0])


STREAM_SCRIPT = """
    import os, torch, ddpkit

    class Lines(torch.utils.data.IterableDataset):  # each rank reads a file of its own: one is shorter
        def __iter__(self):
            for i in range(64 - 16 * (os.environ["RANK"] == "1")):
                yield torch.full((4,), float(i)), torch.tensor(i % 2)

    with ddpkit.Runtime(device="cpu", timeout_s=4) as rt:
        model = rt.setup(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in rt.loader(Lines(), batch_size=8):
            rt.backward(torch.nn.functional.cross_entropy(model(x), y))
            rt.step(opt)
"""


@pytest.mark.cli
def test_a_stream_that_ends_sooner_on_one_rank_names_that_rank(script):
    proc = run_cli("run", "--nproc", "2", script(STREAM_SCRIPT), timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ddpkit run: rank 1 \(pid \d+\) on \S+ failed: rank 1's stream ended after 48 samples of epoch 0, while "
        r"rank\(s\) 0 did not reach the end of theirs in 4 s \(they read on past it, or are that far behind\): an "
        r"IterableDataset must yield the same samples on every rank .*",
        last,
    ), last


@pytest.mark.cli
def test_a_runtime_script_and_launch_inside_a_worker_run_as_that_worker(script):
    # A script of ddpkit's own (rt.print: rank 0 only), whose launch() runs main in the worker itself
    proc = run_cli(
        "run",
        "--nproc",
        "2",
        script("""
            import os, ddpkit

            def main(tag):
                with ddpkit.Runtime(device="cpu", seed=0) as rt:
                    print(f"{tag} rank {rt.rank} of {rt.world_size} in pid {os.getpid()}", flush=True)
                    total = rt.all_reduce(float(rt.rank))
                    rt.print(f"world {rt.world_size} total {total:g}")
                    return rt.rank

            if __name__ == "__main__":
                print("results", ddpkit.launch(main, "inner", nproc=2), "from pid", os.getpid(), flush=True)
        """),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("world 2 total 1") == 1  # rt.print: rank 0 only
    inner = sorted(line for line in proc.stdout.splitlines() if "inner rank" in line)
    assert [line.split(" in pid")[0] for line in inner] == ["[rank0]: inner rank 0 of 2", "[rank1]: inner rank 1 of 2"]
    for rank in (0, 1):  # in the worker's own process, not in a second job
        pid = next(line for line in inner if line.startswith(f"[rank{rank}]")).split()[-1]
        assert f"[rank{rank}]: results {{{rank}: {rank}}} from pid {pid}" in proc.stdout


@pytest.mark.cli
def test_launch_inside_a_worker_refuses_another_size(script):
    proc = run_cli("run", "--nproc", "2", script("import ddpkit\nddpkit.launch(print, nproc=3)\n"))
    assert proc.returncode == 1
    assert "launch(nproc=3) inside a worker of a job of 2 processes already started" in proc.stderr
