"""`ddpkit bench gpt` as a real command at --quick size: the JSON it writes, and what must hold of
its numbers whatever the machine's speed."""

from __future__ import annotations

import math

import pytest

from ddpkit.bench import gpt
from ddpkit.models import gpt_parameters
from tests.bench.helpers import positive_stats
from tests.conftest import run_bench


@pytest.mark.cli
def test_gpt(tmp_path):
    r = run_bench(tmp_path, "gpt", "--gpt-width", "64", "--gpt-heads", "4", "--seq-len", "32")
    w = r["work"]
    assert (w["width"], w["depth"], w["heads"], w["seq_len"], w["precision"]) == (64, 1, 4, 32, "fp32")
    assert r["parameters"] == gpt_parameters(32, gpt.VOCAB, 64, 1)
    assert r["tokens_per_step"] == w["batch_size"] * 32
    assert positive_stats(r["tokens_per_second"]) and positive_stats(r["step_ms"])
    rate = r["tokens_per_second"]["median"]
    for kind, flops in r["flops_per_token"].items():
        assert flops > 0 and math.isclose(r["achieved_tflops"][kind], flops * rate / 1e12, rel_tol=1e-9), kind
        assert r["mfu"][kind] is None  # a CPU has no peak in ddpkit's table
    assert r["loss_finite"] and r["peak_memory_mib"] is None
    assert r["saved_for_backward_mib"] > 0 and w["activation_checkpointing"] is False


@pytest.mark.unit
def test_the_analytic_count_is_6n_outside_the_embeddings_plus_attention():
    work = gpt.Work(64, 2, 4, 32, 8, "fp32", False, 1, 1)
    n = gpt_parameters(32, gpt.VOCAB, 64, 2)
    embeddings = (gpt.VOCAB + 32) * 64
    assert gpt.analytic_flops_per_token(n, work) == 6 * (n - embeddings) + 12 * 2 * 64 * 32
