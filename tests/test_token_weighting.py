"""Token weighting: a gpt trained on sequences of uneven length (ranks and micro-batches hold
different numbers of tokens) under ddp and fsdp (each block a shard unit) on 1, 2 and 3
processes ends with the weights of plain PyTorch on one process taking the mean over every
token of each global batch; the same training weighted by samples, as before token
weighting, does not."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from tests import workers
from tests.test_runtime import WORLD_SIZE_ATOL

# Global batch 10 over 21 sequences of 1 to 12 tokens: not divisible by 3, and the third step
# holds one sequence, so two of three ranks have an empty share (under fsdp, with
# micro-batches of 2, empty micro-batches too). Measured: the token-weighted runs differ from
# the reference by at most 1.8e-7 after 6 steps (float rounding), the sample-weighted ones by
# 0.03 to 0.24.
STEPS, GLOBAL_BATCH = 6, 10
WRONG = 1e-3  # what "does not match" means: a thousand times the tolerance


@pytest.mark.distributed
@pytest.mark.parametrize("strategy,micro", [("ddp", None), ("fsdp", 2)], ids=["ddp", "fsdp-micro-batches"])
def test_token_weighted_steps_equal_one_process_on_1_2_and_3(strategy, micro):
    reference = workers.token_reference(STEPS, GLOBAL_BATCH)  # plain PyTorch, one process
    one = workers.token_weighted_steps(STEPS, GLOBAL_BATCH, micro, strategy)
    torch.testing.assert_close(one["tokens"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
    if micro:  # one process, micro-batches of uneven token counts: weighing them by samples is wrong
        assert (one["samples"] - reference).abs().max() > WRONG
    for nproc in (2, 3):
        out = ddpkit.launch(workers.token_weighted_steps, STEPS, GLOBAL_BATCH, micro, strategy, nproc=nproc)
        for r in range(nproc):
            assert out[r]["strategy"] == strategy
            # Under fsdp every block is a shard unit of its own (so are the embedding and the head).
            assert out[r]["units"] == (["", "block0", "block1", "embed", "head"] if strategy == "fsdp" else [])
            torch.testing.assert_close(out[r]["tokens"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
            assert (out[r]["samples"] - reference).abs().max() > WRONG
