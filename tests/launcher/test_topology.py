"""`topology`: `--nproc` parsing, jobs on one machine that never collide, and the processes
torchrun or srun already started: ddpkit joins them, and refuses flags asking for others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ddpkit.core.device import auto_nproc, gpu_count
from ddpkit.errors import UsageError
from ddpkit.launcher import Nodes, parse_nproc
from ddpkit.launcher import topology as topologies
from tests.conftest import SRC, clean_env


@pytest.mark.unit
def test_nproc_parsing():
    assert parse_nproc("3", "cpu") == 3 and parse_nproc(2, "cpu") == 2
    assert parse_nproc("auto", "cpu") == auto_nproc("cpu") >= 1
    for bad in ("0", "-1", "x", "4097", "99999999999999999999"):  # the last two would start forever
        with pytest.raises(UsageError, match="--nproc"):
            parse_nproc(bad, "cpu")
    # torchrun's spellings: one process per usable core, or per visible GPU (none here: refused)
    assert parse_nproc("cpu", "cpu") == len(os.sched_getaffinity(0))
    if gpu_count() == 0:
        with pytest.raises(UsageError, match="--nproc gpu: no GPU is visible"):
            parse_nproc("gpu", "cpu")


@pytest.mark.unit
def test_nodes_take_an_int_node_count():
    nodes = Nodes(2, 0, "127.0.0.1", 29577)  # was an AttributeError: nnodes had to be the string "2"
    assert nodes == Nodes("2", 0, "127.0.0.1", 29577) and nodes.range() == (2, 2)
    rendezvous = nodes.rendezvous()
    assert rendezvous["rdzv_endpoint"] == "127.0.0.1:29577" and rendezvous["rdzv_configs"] == {"is_host": True}
    assert Nodes(1).range() == (1, 1) and Nodes(1).nnodes == "1"  # what a torchrun check compares with


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"master_port": 70000}, "--master-port"),  # was an OverflowError when a socket met it
        ({"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 65536}, "--master-port"),
        ({"master_port": -1}, "--master-port"),
        ({"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 0}, "--master-port"),  # only the OS knows it
        ({"master_port": "29500"}, "--master-port"),
        ({"node_rank": -1}, "--node-rank"),
        ({"nnodes": 0}, "--nnodes"),
        ({"nnodes": "3:2"}, "--nnodes"),
        ({"nnodes": 2.0}, "--nnodes"),
        ({"rdzv_conf": {"store_type": "file"}}, "--rdzv-conf store_type"),
        ({"rdzv_conf": {"join_timeout": "soon"}}, "--rdzv-conf join_timeout"),
        ({"rdzv_conf": {"join_timeout": "0"}}, "--rdzv-conf join_timeout"),
        ({"rdzv_conf": {"is_host": "maybe"}}, "--rdzv-conf is_host"),
    ],
)
def test_bad_nodes_are_usage_errors_naming_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        Nodes(**kwargs)


@pytest.mark.unit
def test_nodes_rendezvous_settings():
    # One machine: port 0 means "the OS picks", which ddpkit does there anyway; c10d settings pass.
    one = Nodes(1, master_port=0, rdzv_conf={"join_timeout": "30"}).rendezvous()
    assert one["rdzv_endpoint"] == "127.0.0.1:0" and one["rdzv_configs"] == {"join_timeout": 30, "is_host": True}
    two = Nodes(2, 1, "127.0.0.1", 29577, "job", "10.1.2.3", {"read_timeout": 9}).rendezvous()
    assert two == {
        "rdzv_endpoint": "127.0.0.1:29577",
        "rdzv_configs": {"read_timeout": 9, "is_host": False},
        "run_id": "job",
        "local_addr": "10.1.2.3",
    }
    # An explicit is_host wins over --node-rank; no --node-rank leaves it to c10d.
    assert Nodes(2, 0, "127.0.0.1", 1, rdzv_conf={"is_host": "no"}).rendezvous()["rdzv_configs"] == {"is_host": False}
    assert Nodes(2, None, "127.0.0.1", 1).rendezvous()["rdzv_configs"] == {}
    assert Nodes(2, None, "::1", 1, local_addr="::1").rendezvous()["rdzv_endpoint"] == "[::1]:1"


@pytest.mark.unit
def test_under_torchrun_the_topology_is_the_launchers(monkeypatch):
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    topology = topologies.resolve("cpu")
    assert (topology.launcher, topology.nproc, topology.world_size, topology.in_process) == ("torchrun", 1, 2, True)
    with pytest.raises(UsageError, match="drop --nproc, --nnodes and --max-restarts"):
        topologies.resolve("cpu", nproc="2")
    # A one-process strategy cannot be two torchrun ranks: refused before any work starts.
    with pytest.raises(UsageError, match="--strategy dp runs one process, but torchrun started 2"):
        topologies.resolve("cpu", one_process="--strategy dp")


@pytest.mark.cli
@pytest.mark.slow
def test_two_jobs_started_together_do_not_collide(jobs_started_together):
    # `--epochs 1 --nproc 2`, started at the same moment (tests/conftest.py; one of them compiles)
    for out, proc in jobs_started_together.values():
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads((out / "results.json").read_text())["world_size"] == 2


def _slurm_env(rank: int, ntasks: int, port: int) -> dict:
    env = clean_env()
    env.update(
        {
            "SLURM_JOB_ID": "4711",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(ntasks),
            "SLURM_NNODES": "1",
            "SLURM_STEP_NODELIST": "localhost",
            "MASTER_PORT": str(port),
        }
    )
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cli
@pytest.mark.slow
def test_slurm_tasks_train_together(tmp_path):
    # What `srun --ntasks=2 ddpkit train ...` does: two processes with SLURM's variables set.
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddpkit",
                "train",
                "--epochs",
                "1",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "out"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_slurm_env(r, 2, port),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["world_size"] == 2
    assert sum(o[0].count("done:") for o in outs) == 1  # rank 0 reports, once


@pytest.mark.cli
def test_slurm_allocation_mismatch_is_an_immediate_error(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "--nproc", "4", "--device", "cpu", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_slurm_env(0, 2, _free_port()),
    )
    assert proc.returncode == 2 and "under srun" in proc.stderr and "--nproc" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 60  # no waiting for peers that will never come


@pytest.mark.cli
@pytest.mark.slow
def test_ddpkit_train_under_torchrun(tmp_path):
    # torchrun already made the workers: ddpkit must join them, not launch its own.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ddpkit",
            "train",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2 and results["test_samples"] == 359
    assert proc.stdout.count("done:") == 1


RESTARTED_RUNTIME = """
import os, torch, ddpkit
rt = ddpkit.Runtime()
total = torch.ones(1)
torch.distributed.all_reduce(total)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rt.print(f"attempt {attempt} port {os.environ['MASTER_PORT']} sum {total.item()}")
rt.barrier()  # rank 0 has printed before rank 1 dies
if attempt == "0":
    if rt.rank == 1:
        os._exit(3)
    import time
    time.sleep(60)  # stopped by torchrun when rank 1 dies
rt.close()
"""


@pytest.mark.cli
def test_a_runtime_restarted_by_torchrun_does_not_read_the_last_attempts_keys(tmp_path):
    # torchrun (torch 2.13) keeps one store for every attempt of a launch: a restarted group
    # that met under the same keys would dial the last attempt's peers (pytorch/pytorch#135712).
    # On one node ddpkit meets under keys of each attempt's own.
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED_RUNTIME)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1", str(script)]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line.split() for line in proc.stdout.splitlines() if line.startswith("attempt")]
    assert [(words[1], words[5]) for words in said] == [("0", "2.0"), ("1", "2.0")]
    assert said[0][3] == said[1][3]  # the same store: torchrun's, shared by both attempts


@pytest.mark.unit
def test_cpu_processes_are_bounded_by_the_cores():
    from ddpkit.core import device
    from ddpkit.launcher.topology import CPU_OVERSUBSCRIPTION

    most = CPU_OVERSUBSCRIPTION * device.cpu_count()
    assert parse_nproc(str(most), "cpu") == most
    with pytest.raises(UsageError, match=f"--nproc {most + 1} is more than {CPU_OVERSUBSCRIPTION} processes per"):
        parse_nproc(str(most + 1), "cpu")
