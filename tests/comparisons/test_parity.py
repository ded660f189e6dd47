"""`python -m benchmarks parity` as a real command (small --quick sizes), the sample layout
that makes its bitwise weight comparison meaningful, and the verdict on its intervals."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from benchmarks import paired, parity
from ddpkit.core.device import cpu_count
from ddpkit.data import GlobalBatchSampler
from tests.conftest import run_bench


def _hand_batches(hand, work, world, rank, strategy):
    """The index batches the hand-written loop's rank reads, as its own sampler draws them."""
    if strategy == "single":  # the loop's own DataLoader, over the dataset's indices
        loader = parity._hand_loader(work, strategy, torch.utils.data.TensorDataset(torch.arange(len(hand))), False)
        return [batch for (batch,) in loader]
    theirs = list(DistributedSampler(hand, num_replicas=world, rank=rank, shuffle=True, seed=work.seed))
    b = work.global_batch // world
    return [torch.tensor(theirs[k * b : (k + 1) * b]) for k in range(work.steps)]


@pytest.mark.unit
@pytest.mark.parametrize(("world", "strategy"), [(1, "single"), (2, "ddp"), (4, "ddp")])
def test_parity_layout_gives_every_rank_the_hand_written_batches(world, strategy):
    """ddpkit's sampler over the laid-out dataset hands rank r, at step k, exactly the samples
    the hand-written loop's sampler and DataLoader hand rank r: so equal weights mean the
    runtimes agree, and different weights could not be blamed on the data."""
    work = parity.Work(image_size=4, global_batch=8, steps=5)
    hand, kit = parity._datasets(work, world, strategy)
    b = work.global_batch // world
    for rank in range(world):
        theirs = _hand_batches(hand, work, world, rank, strategy)
        ours = list(GlobalBatchSampler(len(kit), work.global_batch, world, rank, shuffle=False))
        assert len(ours) == len(theirs) == work.steps and all(len(batch) == b for batch in ours)
        for batch, idx in zip(ours, theirs):
            assert torch.equal(kit.tensors[0][batch], hand.tensors[0][idx])
            assert torch.equal(kit.tensors[1][batch], hand.tensors[1][idx])


@pytest.mark.unit
def test_verdict_needs_an_interval_narrower_than_the_resolution():
    target, resolution = 1.01, 0.01
    assert paired.verdict(0.90, 0.95, target, resolution) == "not resolved"  # below, but 5% wide
    assert paired.verdict(0.99, 1.05, target, resolution) == "not resolved"  # wide and across
    assert paired.verdict(0.995, 1.004, target, resolution) == "met"
    assert paired.verdict(1.002, 1.010, target, resolution) == "met"  # the bound itself counts as met
    assert paired.verdict(1.012, 1.018, target, resolution) == "not met"
    assert paired.verdict(1.005, 1.013, target, resolution) == "not resolved"  # narrow, but across 1.01


@pytest.mark.unit
def test_paired_ratio_per_round_and_its_interval():
    hand = [100.0 + k % 7 for k in range(20)]
    same = paired.paired_ratio(hand, [h * 1.0 for h in hand], 1.01)
    assert same["ratio"] == 1.0 and same["interval95"] == [1.0, 1.0] and same["status"] == "met"
    slower = paired.paired_ratio(hand, [h * (1.05 + 0.002 * (k % 3)) for k, h in enumerate(hand)], 1.01)
    low, high = slower["interval95"]
    assert 1.05 <= low <= slower["ratio"] <= high <= 1.054 and slower["status"] == "not met"
    noisy = paired.paired_ratio(hand, [h * (0.9 + 0.02 * (k % 10)) for k, h in enumerate(hand)], 1.01)
    assert noisy["width"] > 0.01 and noisy["status"] == "not resolved"
    few = paired.paired_ratio(hand[:3], hand[:3], 1.01)  # a narrow interval, but on 3 rounds
    assert few["interval95"] == [1.0, 1.0] and few["status"] == "not resolved"


@pytest.mark.cli
@pytest.mark.slow
def test_parity(tmp_path):
    r = run_bench(tmp_path, "parity", "--steps", "6", "--rounds", "2", "--nproc-rounds", "2", comparison=True)
    assert r["weights_equal"] is True
    one, many = r["one_process"], r["n_processes"]
    assert one["processes"] == 1 and set(one["strategies"]) == {"single", "ddp", "fsdp"}
    assert many["processes"] == r["nproc"] == 2 and set(many["strategies"]) == {"ddp", "fsdp"}
    # ddpkit's Runtime runs ddp and fsdp on one process as the bare model; on 2 as asked.
    assert {s: c["runs_as"] for s, c in one["strategies"].items()} == dict.fromkeys(one["strategies"], "single")
    assert {s: c["runs_as"] for s, c in many["strategies"].items()} == {"ddp": "ddp", "fsdp": "fsdp"}
    assert many["strategies"]["ddp"]["threads_per_process"] == max(1, cpu_count() // 2)
    for part in (one, many):
        for c in part["strategies"].values():
            # equal because both trained the same, not because neither did
            assert c["weights_equal_per_round"] == [True, True] and c["weights_changed_by_training"] is True
            for side in parity.SIDES:
                assert c["us_per_step"][side]["n"] == 2 and c["us_per_step"][side]["median"] > 0
                assert c["cpu_us_per_step"][side]["median"] > 0
            for stat in ("wall", "cpu"):
                low, high = c[stat]["interval95"]
                assert low <= c[stat]["ratio"] <= high and len(c[stat]["ratio_per_round"]) == 2
                assert c[stat]["status"] == "not resolved"  # two rounds never resolve anything
    assert len(r["verdicts"]) == 2 * (3 + 2) and {v["status"] for v in r["verdicts"]} <= set(paired.STATUSES)
    assert r["target"]["step_time_ratio"] == 1.01 and r["target"]["resolution"] == pytest.approx(0.01)
    assert isinstance(r["meets_target"]["peak_memory_ratio"], bool)
    assert len(r["memory"]["peak_mib"]["ddpkit"]) == 2 and min(r["memory"]["peak_mib"]["ddpkit"]) > 0
    assert "RSS" in r["memory"]["measure"] and r["method"]
