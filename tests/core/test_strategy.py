"""`strategy`: unwrapping a wrapped model, which strategy runs where, DDP keeping the ranks'
weights in step, and DDP's tuning options leaving the weights as they were (or, with the fp16
compression hook, close)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.strategy import unwrap
from tests import workers


@pytest.mark.unit
def test_unwrap_strips_wrappers():
    bare = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(bare)) is bare
    compiled = torch.compile(bare)
    assert unwrap(compiled) is bare
    assert not any(k.startswith("_orig_mod.") for k in unwrap(compiled).state_dict())


@pytest.mark.unit
def test_single_strategy_on_several_processes_is_refused():
    from ddpkit.strategy import resolve_name

    assert resolve_name("single", 1, torch.device("cpu")) == "single"
    with pytest.raises(ValueError, match="unsynchronized"):
        resolve_name("single", 2, torch.device("cpu"))


@pytest.mark.distributed
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


@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [{"gradient_as_bucket_view": True}, {"static_graph": True}, {"bucket_cap_mb": 0.001}],
    ids=["bucket-view", "static-graph", "tiny-buckets"],
)
def test_ddp_tuning_options_keep_the_weights_bit_identical(options):
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    tuned = ddpkit.launch(workers.ddp_options_weights, options, nproc=2, device="cpu")
    assert torch.equal(base[0], base[1]) and torch.equal(tuned[0], tuned[1])
    assert torch.equal(tuned[0], base[0])


@pytest.mark.distributed
def test_fp16_compression_hook_trains_close_to_full_precision():
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    fp16 = ddpkit.launch(workers.ddp_options_weights, {"comm_hook": "fp16"}, nproc=2, device="cpu")
    assert torch.equal(fp16[0], fp16[1])  # every rank applies the same decompressed gradients
    diff = (fp16[0] - base[0]).abs().max().item()
    assert 0 < diff < 1e-2  # rounded to 16 bits on the wire, so close but not equal
