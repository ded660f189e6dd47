"""`ddpkit bench layouts` as a real command at --quick size on 4 processes: the JSON it writes, and
what must hold of its counts whatever the machine's speed: the bytes each layout keeps per rank
and hands to each kind of collective follow from how it splits the model."""

from __future__ import annotations

import math

import pytest

from ddpkit.bench import layouts
from ddpkit.models import gpt_parameters
from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = [pytest.mark.cli, pytest.mark.slow]


def test_layouts(tmp_path):
    r = run_bench(tmp_path, "layouts")
    w = r["work"]
    assert w["processes"] == 4 and set(r["layouts"]) == set(layouts.LAYOUTS)
    whole = 4 * gpt_parameters(w["context"], 256, w["width"], w["depth"])  # fp32 bytes of the model
    mib = 2**20
    for name, (strategy, mesh) in layouts.LAYOUTS.items():
        got = r["layouts"][name]
        assert got["strategy"] == strategy and got["mesh"] == mesh
        memory = got["memory_mib"]
        for rank in range(4):
            # a rank's gradients are shaped like its parameters (under tp alone torch's embedding
            # backward gives the row-wise token embedding a whole gradient); AdamW keeps two values each
            if "tp" in mesh and "dp=2" not in mesh:  # tp 4, pp 2 x tp 2: no FSDP over the tp slices
                assert memory["gradients"][rank] >= memory["parameters"][rank]
            else:
                assert memory["gradients"][rank] == memory["parameters"][rank]
            assert memory["optimizer"][rank] >= 2 * memory["parameters"][rank]
            assert memory["activations"][rank] > 0 and got["peak_mib"][rank] > 0
        assert positive_stats(got["step_seconds"]) and positive_stats(got["hand_written_step_seconds"])
        v = got["vs_hand_written"]
        assert math.isfinite(v["ratio"]) and v["ratio"] > 0 and v["target"] == layouts.TARGET_STEP_TIME_RATIO
    params = {name: [m * mib for m in got["memory_mib"]["parameters"]] for name, got in r["layouts"].items()}
    sent = {name: got["collective_bytes_per_step"][0] for name, got in r["layouts"].items()}
    assert params["ddp"] == [whole] * 4  # a whole copy on every rank
    assert sent["ddp"] == {"all_reduce": whole}  # every gradient all-reduced once per step
    assert sum(params["fsdp"]) == pytest.approx(whole, rel=0.02)  # a quarter each (plus padding)
    assert max(params["fsdp"]) <= 0.3 * whole
    assert set(sent["fsdp"]) == {"all_gather", "reduce_scatter"}
    assert sent["fsdp"]["reduce_scatter"] == pytest.approx(whole, rel=0.02)  # each unit's whole gradients
    assert sum(params["hsdp 2x2"][:2]) == pytest.approx(whole, rel=0.02)  # a replica: two halves
    assert set(sent["hsdp 2x2"]) == {"all_gather", "reduce_scatter", "all_reduce"}  # + across replicas
    assert max(params["fsdp+tp 2x2"]) < 0.35 * whole and max(params["tp 4"]) < 0.5 * whole
    assert "reduce_scatter" not in sent["tp 4"] and sent["tp 4"]["all_reduce"] > 0  # row-wise layers' sums
    # pp 4: a stage per child of the quick gpt (embed, block0, block1, head), its parameters its own;
    # what crosses is one activation per micro-batch forward and its gradient back, between neighbours
    assert sum(params["pp 4"]) == whole and max(params["pp 4"]) < 0.5 * whole
    activation = 4 * w["batch"] * w["context"] * w["width"]  # fp32 bytes of a step's hidden states
    sends = [got["send"] for got in r["layouts"]["pp 4"]["collective_bytes_per_step"]]
    assert set(sent["pp 4"]) == {"send"} and sends == [activation, 2 * activation, 2 * activation, activation]
    # pp 2 x dp 2: two pipelines; a stage's gradients all-reduced once per step over dp (DDP, plus
    # its few bytes of unused-parameter flags); each pipeline sends its half of the batch's states
    pp_dp = params["pp 2 x dp 2"]
    assert pp_dp[0] == pp_dp[1] and pp_dp[2] == pp_dp[3] and pp_dp[0] + pp_dp[2] == whole
    for rank, got in enumerate(r["layouts"]["pp 2 x dp 2"]["collective_bytes_per_step"]):
        assert set(got) == {"send", "all_reduce"} and got["send"] == activation // 2
        assert pp_dp[rank] <= got["all_reduce"] < 1.01 * pp_dp[rank]
    # pp 2 x tp 2: a stage's layers split over tp: under a third of the model per rank
    assert max(params["pp 2 x tp 2"]) < 0.3 * whole
    for got in r["layouts"]["pp 2 x tp 2"]["collective_bytes_per_step"]:
        assert got["send"] == activation and got["all_reduce"] > 0  # row-wise layers' sums
