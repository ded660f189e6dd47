"""`ddpkit bench checkpoint` as a real command at --quick size: fsdp's checkpoints written in the
foreground and in the background, timed, on two processes."""

from __future__ import annotations

import pytest

from tests.bench.helpers import positive_stats
from tests.conftest import run_bench

pytestmark = pytest.mark.cli


def test_checkpoint(tmp_path):
    r = run_bench(tmp_path, "checkpoint", "--width", "64", "--repeats", "2", "--dir", str(tmp_path))
    assert r["processes"] == 2 and r["parameters"] == 64 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    assert r["checkpoint_bytes"] > 3 * 4 * r["parameters"]  # weights and AdamW's two moments, in fp32
    for mode in ("foreground", "background"):
        for key in ("blocked_seconds", "complete_seconds", "steps_seconds"):
            assert positive_stats(r["modes"][mode][key]) and r["modes"][mode][key]["n"] == 2, (mode, key)
        # the call returns once the shards are staged; the checkpoint is complete only later
        assert r["modes"][mode]["blocked_seconds"]["max"] <= r["modes"][mode]["complete_seconds"]["max"]
    assert r["blocked_ratio_background_to_foreground"] > 0
    assert positive_stats(r["checksums_seconds"]) and r["checksums_seconds"]["n"] == 2  # rank 0's read for the CRCs
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("tmp")]  # its folder removed
