"""Real multi-process DDP over gloo on CPU, through ddpkit's launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ddpkit
from ddpkit.errors import WorkerFailed
from tests import workers

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_ranks_hold_identical_weights(nproc):
    out = ddpkit.launch(workers.train_steps, steps=4, global_batch=12, nproc=nproc)
    assert sorted(out) == list(range(nproc))
    assert {r["world"] for r in out.values()} == {nproc}
    assert {r["strategy"] for r in out.values()} == {"ddp"}
    assert {r["batch"] for r in out.values()} == {12 // nproc}  # the global batch is split
    # Ranks built different initial weights; DDP broadcast rank 0's, then kept them in step.
    for r in range(1, nproc):
        assert torch.equal(out[r]["start"], out[0]["start"])
        assert torch.equal(out[r]["end"], out[0]["end"])
    assert not torch.equal(out[0]["start"], out[0]["end"])  # training did move them


# Tolerance for "the same training on another number of processes". The all-reduce adds the
# ranks' gradient sums in another order than one process sums its batch; float32 addition is
# not associative, so each step may differ in the last bit (~6e-8 on weights of order 1).
# Measured: 6e-8 to 9e-8 after 8 momentum-SGD steps. atol 1e-6 allows ~8 ulps, and would
# still catch any real difference in data order or gradient weighting (those are > 1e-3).
WORLD_SIZE_ATOL = 1e-6


@pytest.mark.parametrize("global_batch,micro", [(12, None), (10, None), (12, 2), (7, 3), (89, None)],
                         ids=["even", "uneven-over-3", "accumulate", "uneven-and-accumulate",
                              "empty-shares"])  # 90 samples: each epoch ends with a 1-sample batch
def test_same_weights_on_1_2_and_3_processes(global_batch, micro):
    reference = workers.plain_reference(8, global_batch)  # plain PyTorch, one process, no ddpkit
    one = workers.invariant_steps(8, global_batch, micro)
    torch.testing.assert_close(one["params"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
    for nproc in (2, 3):
        out = ddpkit.launch(workers.invariant_steps, 8, global_batch, micro, nproc=nproc)
        for r in range(nproc):
            torch.testing.assert_close(out[r]["params"], one["params"], rtol=0, atol=WORLD_SIZE_ATOL)
            assert out[r]["position"] == one["position"]


def test_each_rank_draws_its_own_random_stream_after_setup():
    out = ddpkit.launch(workers.rank_streams, nproc=2)
    assert torch.equal(out[0]["init"], out[1]["init"])  # model init: identical everywhere
    assert not torch.equal(out[0]["torch"], out[1]["torch"])
    assert out[0]["numpy"] != out[1]["numpy"] and out[0]["python"] != out[1]["python"]
    again = ddpkit.launch(workers.rank_streams, nproc=2)  # and reproducibly so
    assert all(torch.equal(again[r]["torch"], out[r]["torch"]) and again[r]["numpy"] == out[r]["numpy"]
               for r in (0, 1))


@pytest.mark.parametrize("nproc,n", [(2, 37), (3, 37), (3, 1)])
def test_odd_test_set_counted_exactly_once(nproc, n):
    out = ddpkit.launch(workers.evaluate_odd, n, nproc=nproc)
    reference = workers.evaluate_odd(n)  # one process, no sharding
    assert reference["samples"] == n
    assert sum(r["shard"] for r in out.values()) == n  # shards partition the set: no padding
    for r in out.values():
        assert r["samples"] == n
        assert r["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_collectives_across_three_ranks():
    out = ddpkit.launch(workers.collectives, nproc=3)
    for r in out.values():
        assert r["sum"] == 6.0 and r["mean"] == 1.0 and r["max"] == 2.0
        assert r["shapes"] == [(1, 2), (2, 2), (3, 2)]  # different sizes per rank survive
        assert r["values"] == [[0.0], [1.0], [2.0]]
        assert r["obj"] == {"from": 0, "list": [1, 2]}
        assert r["objs"] == ["rank0", "rank1", "rank2"]


def test_collectives_with_one_process():
    r = workers.collectives()
    assert r["sum"] == 1.0 and r["mean"] == 0.0 and r["max"] == 0.0
    assert r["shapes"] == [(1, 2)] and r["obj"] == {"from": 0, "list": [1, 2]} and r["objs"] == ["rank0"]


def test_checkpoint_from_ddp_loads_into_plain_model_and_back(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = ddpkit.launch(workers.save_under_ddp, path, nproc=2)
    assert saved[0]["wrapped"] == "DistributedDataParallel"
    state = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    plain = workers.toy_model(seed=123)
    plain.load_state_dict(state["model"])  # strict: the bare model's own keys
    torch.testing.assert_close(workers.flat_params(plain), saved[0]["params"], rtol=0, atol=0)
    assert "state" in state["optimizer"] and state["note"] == "ddp"
    # ...and back: a plain checkpoint loaded into a DDP-wrapped model on 2 ranks.
    back = ddpkit.launch(workers.load_under_ddp, path, nproc=2)
    for r in back.values():
        assert r["wrapped"] == "DistributedDataParallel" and r["note"] == "ddp"
        torch.testing.assert_close(r["params"], saved[0]["params"], rtol=0, atol=0)


def test_failing_worker_stops_the_run_and_names_its_rank():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(workers.fail_on_rank, 1, nproc=3)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "deliberate failure on rank 1" in str(info.value)
    assert "ValueError" in str(info.value) and "deliberate failure" in info.value.traceback
    # The other ranks were blocked in a barrier; the agent must stop them, not wait 10 minutes.
    assert elapsed < 60, f"took {elapsed:.0f}s"


def test_launcher_sets_rank_env_and_thread_share():
    out = ddpkit.launch(workers.env_facts, nproc=2)
    assert [out[r]["RANK"] for r in (0, 1)] == ["0", "1"]
    assert {out[r]["WORLD_SIZE"] for r in (0, 1)} == {"2"}
    assert {out[r]["MASTER_ADDR"] for r in (0, 1)} == {"127.0.0.1"}  # loopback only on one machine
    assert {out[r]["OMP_NUM_THREADS"] for r in (0, 1)} == {str(max(1, len(os.sched_getaffinity(0)) // 2))}


def test_launch_leaves_the_callers_environment_as_it_was():
    import logging

    assert "OMP_NUM_THREADS" not in os.environ
    ddpkit.launch(workers.env_facts, nproc=2)
    assert "OMP_NUM_THREADS" not in os.environ
    # torch sets its agent's log level when the module is first imported (by the launch above);
    # ddpkit silences it only during a launch and must hand it back afterwards.
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.setLevel(logging.INFO)
    level = agent_log.level
    ddpkit.launch(workers.env_facts, nproc=2)
    assert "OMP_NUM_THREADS" not in os.environ  # a later launch with another nproc starts clean
    assert agent_log.level == level


def test_launch_from_a_script_without_main_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import os, ddpkit
        print("top level", flush=True)

        def work():
            return int(os.environ["RANK"])

        print("results", ddpkit.launch(work, nproc=2))
    """))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("top level") == 1  # the workers did not re-run the script
    assert "results {0: 0, 1: 1}" in proc.stdout


def _python(program: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-"], input=textwrap.dedent(program), capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_launch_function_defined_in_stdin_program():
    # `python -` has no main file for spawn to re-import: the classic "DDP can't run here" case.
    proc = _python("""
        import ddpkit, torch
        OFFSET = 100

        def main(scale):
            with ddpkit.Runtime(device="cpu") as rt:
                total = rt.all_reduce(torch.tensor([float(rt.rank + OFFSET)]))
                rt.print("total", total.item())
                return rt.rank * scale

        print("results", ddpkit.launch(main, 10, nproc=2))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "results {0: 0, 1: 10}" in proc.stdout
    assert proc.stdout.count("total 201.0") == 1  # rank 0 only


def test_program_whose_worker_raises_exits_nonzero_quickly():
    t0 = time.monotonic()
    proc = _python("""
        import sys, ddpkit

        def main():
            with ddpkit.Runtime(device="cpu") as rt:
                if rt.rank == 1:
                    raise RuntimeError("rank one broke")
                rt.barrier()

        try:
            ddpkit.launch(main, nproc=2)
        except ddpkit.WorkerFailed as err:
            print(err, file=sys.stderr)
            sys.exit(1)
    """)
    assert proc.returncode == 1
    assert "rank 1" in proc.stderr and "RuntimeError: rank one broke" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_precision_bf16_and_fp16_train_on_cpu():
    for precision in ("bf16", "fp16"):
        out = workers.train_steps(steps=6, global_batch=12, precision=precision)
        assert torch.isfinite(out["end"]).all()
        assert not torch.equal(out["start"], out["end"])


def test_ddpkit_train_under_torchrun(tmp_path):
    # torchrun already made the workers: ddpkit must join them, not launch its own.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ddpkit", "train", "--epochs", "1", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2 and results["test_samples"] == 359
    assert proc.stdout.count("done:") == 1


def test_slow_rank0_save_does_not_trip_the_others_timeout(tmp_path):
    # timeout 2 s, a save taking 5 s: the others wait in the long-timeout group, not the default.
    out = ddpkit.launch(workers.slow_save_on_main, str(tmp_path / "c.pt"), 2.0, 5.0, nproc=2)
    assert out == {0: "saved", 1: "saved"}
    assert "model" in torch.load(tmp_path / "c.pt", weights_only=True)
