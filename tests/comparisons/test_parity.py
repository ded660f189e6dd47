"""`python -m benchmarks parity` as a real command (small --quick sizes), and the sample layout
that makes its bitwise weight comparison meaningful."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from benchmarks import parity
from ddpkit.data import GlobalBatchSampler
from ddpkit.device import cpu_count
from tests.conftest import run_bench


@pytest.mark.unit
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
            idx = torch.tensor(theirs[k * b : (k + 1) * b])
            assert torch.equal(kit.tensors[0][batch], hand.tensors[0][idx])
            assert torch.equal(kit.tensors[1][batch], hand.tensors[1][idx])


@pytest.mark.cli
@pytest.mark.slow
def test_parity(tmp_path):
    r = run_bench(tmp_path, "parity", "--steps", "8", comparison=True)
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
