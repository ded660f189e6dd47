"""`python -m benchmarks parity`, `ddpkit bench workers` and `strategies` as real commands (small --quick sizes), and
the sample layout that makes the parity benchmark's bitwise weight comparison meaningful."""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DistributedSampler

from benchmarks import parity
from ddpkit.data import GlobalBatchSampler
from ddpkit.device import cpu_count

from .conftest import run_bench

def bench(tmp_path, name: str, *flags: str) -> dict:
    return run_bench(tmp_path, name, *flags, comparison=name == "parity")


@pytest.mark.parametrize("world", [2, 4])
def test_parity_layout_gives_every_rank_the_hand_written_batches(world):
    """ddpkit's sampler over the laid-out dataset hands rank r, at step k, exactly the samples
    the hand-written DistributedSampler + DataLoader hand rank r: so equal weights mean
    the runtimes agree, and different weights could not be blamed on the data."""
    work = parity.Work(image_size=4, global_batch=8, steps=5)
    hand, kit = parity._datasets(work, world)
    b = work.global_batch // world
    for rank in range(world):
        theirs = list(DistributedSampler(hand, num_replicas=world, rank=rank, shuffle=True, seed=work.seed))
        ours = list(GlobalBatchSampler(len(kit), work.global_batch, world, rank, shuffle=False))
        assert len(ours) == work.steps and all(len(batch) == b for batch in ours)
        for k, batch in enumerate(ours):
            idx = torch.tensor(theirs[k * b:(k + 1) * b])
            assert torch.equal(kit.tensors[0][batch], hand.tensors[0][idx])
            assert torch.equal(kit.tensors[1][batch], hand.tensors[1][idx])


def test_parity(tmp_path):
    r = bench(tmp_path, "parity", "--steps", "8")
    assert r["weights_equal"] is True, r["weights_equal_per_round"]
    assert r["weights_changed_by_training"] is True  # equal because both trained the same, not because neither did
    assert r["nproc"] == 2 and r["threads_per_process"] == max(1, cpu_count() // 2)
    for key in ("step_time_ratio", "peak_memory_ratio"):
        assert isinstance(r[key], float) and 0 < r[key] < 100
    assert set(r["meets_target"]) == {"step_time_ratio", "peak_memory_ratio", "weights_equal"}
    assert all(isinstance(v, bool) for v in r["meets_target"].values())
    assert r["target"]["step_time_ratio"] == 1.01
    for side in ("hand_written", "ddpkit"):
        assert r["step_seconds"][side]["n"] >= 2 and r["step_seconds"][side]["median"] > 0
        assert len(r["memory"]["peak_mib"][side]) == 2 and min(r["memory"]["peak_mib"][side]) > 0
    assert "RSS" in r["memory"]["measure"] and r["method"]


def test_workers(tmp_path):
    r = bench(tmp_path, "workers", "--samples", "256", "--batch-sizes", "32,64", "--image-size", "16")
    assert r["pin_memory"] == [False] and "n/a" in r["pin_memory_note"]
    assert {x["num_workers"] for x in r["results"]} >= {0, 1, 2, 4}
    assert {x["batch_size"] for x in r["results"]} == {32, 64}
    assert all(x["samples_per_second"]["median"] > 0 and x["first_batch_seconds"] > 0 for x in r["results"])
    best = r["best"]
    assert set(best) >= {"num_workers", "pin_memory", "samples_per_second"}
    assert any(x["num_workers"] == best["num_workers"] and x["batch_size"] == best["batch_size"] for x in r["results"])
    assert best["samples_per_second"] > 0 and best["pin_memory"] is False


def test_strategies(tmp_path):
    r = bench(tmp_path, "strategies", "--batch-per-device", "8", "--image-size", "8", "--max-devices", "2")
    assert r["scaling"] == "weak"
    assert set(r["scaling_efficiency"]) == {"single", "ddp"}
    assert "dp" in r["unavailable"] and "GPU" in r["unavailable"]["dp"]
    assert set(r["throughput"]["ddp"]) == {"1", "2"} and set(r["throughput"]["single"]) == {"1"}
    for strategy, by_n in r["scaling_efficiency"].items():
        assert by_n["1"] == 1.0, strategy
        assert all(isinstance(v, float) and v > 0 for v in by_n.values())
    assert r["global_batch"]["ddp"] == {"1": 8, "2": 16}
    assert r["threads_per_process"]["ddp"]["2"] == max(1, cpu_count() // 2)
    assert "| ddp | 2 |" in r["table"]
