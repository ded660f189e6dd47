"""`seed`: model initialization is the same on every rank, and each rank draws its own random
stream after setup, reproducibly."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from tests import workers

pytestmark = pytest.mark.distributed


def test_each_rank_draws_its_own_random_stream_after_setup():
    out = ddpkit.launch(workers.rank_streams, nproc=2)
    assert torch.equal(out[0]["init"], out[1]["init"])  # model init: identical everywhere
    assert not torch.equal(out[0]["torch"], out[1]["torch"])
    assert out[0]["numpy"] != out[1]["numpy"] and out[0]["python"] != out[1]["python"]
    again = ddpkit.launch(workers.rank_streams, nproc=2)  # and reproducibly so
    assert all(torch.equal(again[r]["torch"], out[r]["torch"]) and again[r]["numpy"] == out[r]["numpy"] for r in (0, 1))
