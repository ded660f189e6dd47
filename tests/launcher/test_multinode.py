"""Two machines for real: two network namespaces joined by a veth pair, each a host with its own
address. torchrun's c10d rendezvous and gloo run between them exactly as between two servers."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import LAUNCH_VARS

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """Two namespaces, 10.N.0.1 and 10.N.0.2; yields [(namespace, interface, address), ...]."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"{os.getpid() % 10000}{random.randint(0, 99)}"
    net = 100 + random.randint(0, 150)
    names = [f"ddpk{tag}a", f"ddpk{tag}b"]
    links = [f"dk{tag}a", f"dk{tag}b"]
    made = _ip("netns", "add", names[0])
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here (needs root): {made.stderr.strip()}")
    try:
        steps = [("netns", "add", names[1]), ("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for i in (0, 1):
            steps += [
                ("link", "set", links[i], "netns", names[i]),
                ("-n", names[i], "addr", "add", f"10.{net}.0.{i + 1}/24", "dev", links[i]),
                ("-n", names[i], "link", "set", links[i], "up"),
                ("-n", names[i], "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield [(names[i], links[i], f"10.{net}.0.{i + 1}") for i in (0, 1)]
    finally:
        for name in names:
            _ip("netns", "del", name)


def _on_both(hosts, make_args, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start `python -m ddpkit ARGS` on both hosts at once (node ranks 0 and 1); wait for both."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    procs = []
    for rank, (ns, link, _) in enumerate(hosts):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            f"GLOO_SOCKET_IFNAME={link}",
            sys.executable,
            "-m",
            "ddpkit",
            *make_args(rank),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _node_flags(hosts, rank: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", hosts[0][2], "--master-port", "29500"]


def test_ddpkit_train_across_two_hosts_matches_one_host(hosts, two_process_run, tmp_path):
    runs = _on_both(
        hosts,
        lambda r: [
            "train",
            "--nproc",
            "1",
            "--epochs",
            "2",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / f"node{r}"),
            *_node_flags(hosts, r),
        ],
    )
    for p in runs:
        assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((tmp_path / "node0" / "results.json").read_text())
    assert results["world_size"] == 2 and results["test_samples"] == 359
    assert not (tmp_path / "node1" / "results.json").exists()  # global rank 0 writes, once
    local, proc = two_process_run  # the same run on one host: --nproc 2 --epochs 2 (tests/conftest.py)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = torch.load(tmp_path / "node0" / "model.pt", weights_only=True)
    b = torch.load(local / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # same world size, other wires


def test_ddpkit_run_across_two_hosts_keeps_weights_identical(hosts, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import socket, torch, torch.nn.functional as F, ddpkit
        with ddpkit.Runtime(device="cpu", seed=0) as rt:
            model = torch.nn.Linear(6, 3)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = rt.setup(model, opt)
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
            for x, y in rt.loader(data, batch_size=16):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(opt)
            torch.save({{"host": socket.gethostname(), "w": rt.unwrap(model).weight.detach()}},
                       "{tmp_path}/rank%d.pt" % rt.rank)
    """)
    )
    runs = _on_both(hosts, lambda r: ["run", "--nproc", "2", *_node_flags(hosts, r), str(script)])
    for p in runs:
        assert p.returncode == 0, p.stderr[-3000:]
    weights = [torch.load(tmp_path / f"rank{r}.pt")["w"] for r in range(4)]  # 2 hosts x 2 processes
    assert all(torch.equal(w, weights[0]) for w in weights)
