"""`plan.work`: every operation a step dispatches, counted with its FLOPs (torch's formulas) and
the bytes it moves; the CPU's time model over them."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ddpkit.plan.work import Counting, OpKind, Ops

pytestmark = pytest.mark.unit


def test_products_and_attention_are_counted_with_their_flops_and_bytes_views_are_not():
    with FakeTensorMode():
        a, b = torch.randn(64, 32), torch.randn(32, 16, requires_grad=True)
        q = torch.randn(2, 4, 16, 8)
        with Counting() as counting:
            y = a @ b  # 2 * 64 * 32 * 16 FLOPs, (64*32 + 32*16 + 64*16) * 4 bytes
            y.t()  # a view: nothing moved
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    ops = counting.ops
    assert ops.counts[2 * 64 * 32 * 16, (64 * 32 + 32 * 16 + 64 * 16) * 4, False, False, "aten.mm.default"] == 1
    attention = [(op.flops, n) for op, n in ops.counts.items() if op.attention]
    assert attention == [(4 * 2 * 4 * 16 * 16 * 8, 1)]  # QK^T and AV, counted whole (causal or not)
    assert ops.calls == 2 and ops.flops == 2 * 64 * 32 * 16 + 4 * 2 * 4 * 16 * 16 * 8


def test_each_operation_takes_the_longer_of_its_flops_and_its_bytes_plus_its_dispatch():
    ops = Ops(
        Counter(
            {
                OpKind(100, 10, False, False, "mm"): 2,
                OpKind(0, 50, True, False, "add"): 1,
                OpKind(40, 0, False, True, "sdpa"): 1,
            }
        )
    )
    # products at 10 FLOP/s, attention at 4, bytes at 5 per s; 1 s per operation, 3 more on DTensors
    seconds = ops.seconds(10.0, 5.0, 1.0, 3.0, attention_flops_per_s=4.0)
    assert seconds == pytest.approx(2 * max(10, 2) + 10 + 10 + 4 * 1 + 1 * 3)
    assert ops.distributed_calls == 1 and ops.to_json()["bytes"] == 70


def test_operations_of_a_deeper_model_grow_by_one_blocks_worth_each():
    mm, norm = OpKind(1, 1, False, False, "mm"), OpKind(9, 9, False, False, "norm")
    two = Ops(Counter({mm: 5, norm: 1}))
    three = Ops(Counter({mm: 7, norm: 1}))
    assert three.extrapolated(three, 5).counts == three.counts
    assert two.extrapolated(three, 4).counts == Counter({mm: 13, norm: 1})


def test_an_operation_over_the_whole_model_grows_in_size_not_in_number():
    # The optimizer's multi-tensor step over every parameter: one operation, larger in the deeper
    # model (and of two sizes: two of them over different lists); a block's own product alongside.
    def step(blocks: int) -> Ops:
        return Ops(
            Counter(
                {
                    OpKind(2, 2, False, False, "mm"): 3 * blocks,
                    OpKind(0, 100 + 40 * blocks, True, False, "foreach_add"): 1,
                    OpKind(0, 10 + 4 * blocks, True, False, "foreach_add"): 1,
                    OpKind(5 * blocks, 60 * blocks, False, False, "bucket_copy"): 2,
                }
            )
        )

    assert step(2).extrapolated(step(3), 7).counts == step(9).counts
    assert step(3).extrapolated(step(3), 4).counts == step(3).counts
    # one of a name gone and two new ones: which became which is not known, so none is paired
    old, new = OpKind(0, 100, False, False, "cat"), [OpKind(0, b, False, False, "cat") for b in (120, 5)]
    grown = Ops(Counter({old: 1})).extrapolated(Ops(Counter(dict.fromkeys(new, 1))), 5).counts
    assert grown == Counter(dict.fromkeys(new, 5))


@pytest.mark.parametrize("nproc", [1, 2, 3, 5, 7, 8])
def test_the_calibrations_collectives_split_evenly_over_any_number_of_processes(nproc):
    # `ddpkit plan --gpu cpu --gpus-per-node 3` failed in gloo's reduce-scatter: 256 floats do
    # not split into 3 equal parts.
    from ddpkit.plan.calibrate import SIZES, collective_numels

    numels = collective_numels(nproc)
    assert all(n % nproc == 0 for n in numels)
    assert all(size // 4 - nproc < n <= size // 4 for n, size in zip(numels, SIZES) if size // 4 >= nproc)
