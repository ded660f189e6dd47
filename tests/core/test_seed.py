"""`seed`: model initialization is the same on every rank, and each rank draws its own random
stream after setup, reproducibly."""

from __future__ import annotations

import collections
import io

import pytest
import torch

import ddpkit
from tests import workers

pytestmark = pytest.mark.distributed

Pair = collections.namedtuple("Pair", "a b")  # (pickled by reference: defined at the top)


def test_each_rank_draws_its_own_random_stream_after_setup():
    out = ddpkit.launch(workers.rank_streams, nproc=2)
    assert torch.equal(out[0]["init"], out[1]["init"])  # model init: identical everywhere
    assert not torch.equal(out[0]["torch"], out[1]["torch"])
    assert out[0]["numpy"] != out[1]["numpy"] and out[0]["python"] != out[1]["python"]
    again = ddpkit.launch(workers.rank_streams, nproc=2)  # and reproducibly so
    assert all(torch.equal(again[r]["torch"], out[r]["torch"]) and again[r]["numpy"] == out[r]["numpy"] for r in (0, 1))


def _gathered_both_ways() -> tuple[list, list]:
    from ddpkit.core import dist, seed

    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        seed.seed_rank(0, rt.rank)
        state = {**seed.rng_state(rt.device), "generators": [torch.Generator().manual_seed(100 + rt.rank).get_state()]}
        return seed.gather_states(state), dist.gather_objects(state)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_ranks_streams_gathered_as_bytes_come_back_as_they_were():
    out = ddpkit.launch(_gathered_both_ways, nproc=2)
    fast, plain = out[0]
    assert _same(fast, plain) and _same(out[1][0], plain)  # the same tensors, tuples and numbers
    assert not _same(fast[0], fast[1])  # each rank's own streams, in rank order
    assert fast[1]["generators"][0].dtype == torch.uint8 and isinstance(fast[0]["python"], tuple)


def test_states_as_bytes_come_back_as_they_were_whatever_their_tensors():
    import pickle

    from ddpkit.core.seed import _from_bytes, _to_bytes

    state = {
        "empty": torch.empty(0, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(3),
        "named": Pair(torch.ones(2, 3), None),
        "plain": (1, 2.5, "x", None),
        "list": [torch.zeros(2, dtype=torch.bool)],
    }
    back = _from_bytes(pickle.loads(pickle.dumps(_to_bytes(state))))  # as gather_objects carries it
    assert _same(back, state) and type(back["named"]) is Pair


def test_pythons_stream_is_kept_as_one_tensor_and_the_older_tuple_still_restores():
    import random

    from ddpkit.core.seed import rng_state, set_rng_state

    cpu = torch.device("cpu")
    random.seed(11)
    state = rng_state(cpu)
    version, internal, gauss = state["python"]
    assert isinstance(internal, torch.Tensor) and internal.tolist() == list(random.getstate()[1])
    ahead = [random.random() for _ in range(5)]
    set_rng_state(state, cpu)
    assert [random.random() for _ in range(5)] == ahead
    buffer = io.BytesIO()  # as a checkpoint holds it: through torch.save and a weights-only load
    torch.save(state, buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    set_rng_state(state, cpu)
    assert [random.random() for _ in range(5)] == ahead
    older = {**state, "python": random.getstate()}  # how ddpkit 0.1's checkpoints hold it
    ahead = [random.random() for _ in range(5)]
    set_rng_state(older, cpu)
    assert [random.random() for _ in range(5)] == ahead
