"""`dist`: where a process learns its rank (SLURM, torchrun, or a plain process), the collectives
on one process and across three, and the long-timeout group that lets rank 0 write a slow
checkpoint while the others wait."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit.core import dist
from tests import workers


@pytest.mark.unit
@pytest.mark.parametrize(
    "nodelist,host",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node1", "node1"), ("a[3]", "a3"), ("n[001-004]", "n001"), ("x1,x2", "x1")],
)
def test_first_slurm_host(nodelist, host):
    assert dist.first_slurm_host(nodelist) == host


@pytest.mark.unit
def test_detect_env_from_slurm(monkeypatch):
    for k, v in {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpu[3-4]",
    }.items():
        monkeypatch.setenv(k, v)
    env = dist.detect_env()
    assert (env.source, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("slurm", 5, 1, 8, 4)
    assert env.master_addr == "gpu3" and env.master_port == 15000 + 4242


@pytest.mark.unit
def test_detect_env_torchrun_wins_over_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for k, v in {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    env = dist.detect_env()
    assert (env.source, env.rank, env.world_size) == ("torchrun", 2, 3)


@pytest.mark.unit
def test_plain_process_is_single():
    env = dist.detect_env()
    assert env.source == "single" and not env.is_distributed


@pytest.mark.distributed
def test_collectives_across_three_ranks():
    out = ddpkit.launch(workers.collectives, nproc=3)
    for r in out.values():
        assert r["sum"] == 6.0 and r["mean"] == 1.0 and r["max"] == 2.0
        assert r["shapes"] == [(1, 2), (2, 2), (3, 2)]  # different sizes per rank survive
        assert r["values"] == [[0.0], [1.0], [2.0]]
        assert r["obj"] == {"from": 0, "list": [1, 2]}
        assert r["objs"] == ["rank0", "rank1", "rank2"]
        assert r["rows"] == [[0.0, 0.0, -1.0], [1.0, 0.5, -1.0], [2.0, 1.0, -1.0]]  # rank order, as sent


@pytest.mark.unit
def test_collectives_with_one_process():
    r = workers.collectives()
    assert r["sum"] == 1.0 and r["mean"] == 0.0 and r["max"] == 0.0
    assert r["shapes"] == [(1, 2)] and r["obj"] == {"from": 0, "list": [1, 2]} and r["objs"] == ["rank0"]
    assert r["rows"] == [[0.0, 0.0, -1.0]]  # no process group: this rank's own


@pytest.mark.distributed
def test_slow_rank0_save_does_not_trip_the_others_timeout(tmp_path):
    # timeout 2 s, a save taking 5 s: the others wait in the long-timeout group, not the default.
    out = ddpkit.launch(workers.slow_save_on_main, str(tmp_path / "c.pt"), 2.0, 5.0, nproc=2)
    assert out == {0: "saved", 1: "saved"}
    assert "model" in torch.load(tmp_path / "c.pt", weights_only=True)


@pytest.mark.unit
def test_a_runtime_refuses_launcher_variables_of_a_job_that_is_not_there(monkeypatch):
    import ddpkit

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ddpkit.UsageError, match=r"RANK=0 WORLD_SIZE=2 are set, .* but MASTER_PORT is not"):
        ddpkit.Runtime("ddp", device="cpu")  # before: a silent wait of timeout_s for the other rank
    monkeypatch.setenv("WORLD_SIZE", "1")  # a job of one: nothing to wait for
    with ddpkit.Runtime("ddp", device="cpu") as rt:
        assert rt.world_size == 1


@pytest.mark.unit
def test_a_runtime_whose_peers_never_come_says_so_at_its_timeout(monkeypatch):
    # MASTER_PORT set too: a job that could be there, so it is waited for, up to timeout_s
    from tests.cli.helpers import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ddpkit.UsageError, match=r"^rank 0 of 2: waited 1 s for 1 more of the job's 2 processes"):
        ddpkit.Runtime("ddp", device="cpu", timeout_s=1.0)
    assert not torch.distributed.is_initialized()


@pytest.mark.distributed
def test_runtimes_one_after_another_in_a_worker_each_make_their_group():
    # Each Runtime destroys the group it made; the next makes one again through the same agent
    # store, which still held the last group's addresses: a rank dialled a closed port
    # ("Gloo connectFullMesh failed ... Connection refused") in about half of such runs.
    out = ddpkit.launch(workers.sequential_runtimes, 3, nproc=2)
    assert out[0] == out[1] == [3.0, 3.0, 3.0]
