"""`python -m benchmarks startup` runs the same job under ddpkit and under torchrun, refuses an
unknown contender and names what is missing for the others."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_comparison


@pytest.mark.cli
@pytest.mark.slow
def test_bench_startup_runs_the_same_job_under_ddpkit_and_torchrun(tmp_path):
    path, png = tmp_path / "x.json", tmp_path / "x.png"
    t0 = time.monotonic()
    proc = run_comparison(
        "startup",
        "--quick",
        "--repeats",
        "1",
        "--contenders",
        "ddpkit,torchrun",
        "--json",
        str(path),
        "--plot",
        str(png),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(path.read_text())["result"]
    assert set(r["contenders"]) == {"ddpkit", "torchrun"}, (r["skipped"], r["retried"])
    assert set(r["skipped"]) == {"accelerate", "fabric"}  # not selected
    for c in r["contenders"].values():
        assert c["wall_seconds"]["n"] == 1 and c["wall_seconds"]["median"] > 0
        assert c["test_accuracy"] > 0.9  # both trained the digits, not merely started
    ddp = r["contenders"]["ddpkit"]
    assert 0 < ddp["results_wall_seconds"]["median"] < ddp["wall_seconds"]["median"]
    # ddpkit's start-up breakdown: every phase of its timeline, then its exit seen from outside
    assert list(ddp["phases"])[0] == "imports_done"
    assert list(ddp["phases"])[-3:] == ["workers_exited", "curves_drawn", "exit"]
    assert all(s["n"] == 1 and s["median"] >= 0 for s in ddp["phases"].values())
    assert sum(s["median"] for s in ddp["phases"].values()) == pytest.approx(ddp["wall_seconds"]["median"])
    assert "ddpkit phase model_ready (median)" in proc.stdout
    assert set(r["speedup_vs"]) == {"torchrun"} and isinstance(r["ddpkit_fastest"], bool)
    assert r["best_peer"] == "torchrun" and r["target_ratio"] == 0.7
    assert r["ddpkit_over_best_peer"] == pytest.approx(1 / r["speedup_vs"]["torchrun"])
    assert "ddpkit / best peer (torchrun)" in proc.stdout
    # the same target paired by round: one round here, too few for a verdict
    paired = r["paired"]
    assert paired["per_round"] == [ddp["seconds_per_round"][0] / r["contenders"]["torchrun"]["seconds_per_round"][0]]
    assert paired["status"] == "not resolved" and "paired by round" in proc.stdout
    assert r["job"]["epochs"] == 10 and r["job"]["processes"] == 2
    assert png.stat().st_size > 0
    assert "ddpkit fastest" in proc.stdout
    # rank 0's steady training steps, timed alike in both (the loops' own cost, launch apart)
    for c in r["contenders"].values():
        # a steady step takes less than the whole command over its 230 steps, and more than nothing
        assert 0 < c["step_ms"]["p50"]["median"] < c["wall_seconds"]["median"] / 230 * 1000
        assert c["step_ms"]["mean"]["n"] == 1
    assert "torchrun training step, rank 0" in proc.stdout
    assert time.monotonic() - t0 < 120


@pytest.mark.cli
def test_bench_startup_bad_contender():
    proc = run_comparison("startup", "--contenders", "ddpkit,nosuch")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--contenders" in lines[0] and "nosuch" in lines[0]


@pytest.mark.unit
def test_bench_startup_names_what_is_missing(monkeypatch):
    import importlib.util

    from benchmarks import startup

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    assert "lightning is not installed" in startup._missing("fabric") and "ddpkit[bench]" in startup._missing("fabric")
    assert startup._missing("torchrun") is None


@pytest.mark.unit
def test_bench_startup_target_is_ddpkit_over_the_best_peer():
    from benchmarks.startup import versus_best_peer

    def of(**medians):
        return {n: {"wall_seconds": {"median": m}} for n, m in medians.items()}

    v = versus_best_peer(of(ddpkit=5.6, torchrun=8.0, accelerate=7.0, fabric=11.0))
    assert v["best_peer"] == "accelerate" and v["ddpkit_over_best_peer"] == pytest.approx(0.8)
    assert v["target_met"] is False and v["target_ratio"] == 0.7
    assert versus_best_peer(of(ddpkit=4.2, torchrun=7.0))["target_met"] is True
    alone = versus_best_peer(of(ddpkit=5.0))
    assert alone["best_peer"] is None and alone["ddpkit_over_best_peer"] is None and alone["target_met"] is None


@pytest.mark.unit
def test_bench_startup_pairs_the_rounds():
    from benchmarks.startup import paired_by_round

    def ran(*seconds):
        return {"seconds_per_round": list(seconds)}

    # ddpkit at 0.65-0.68 of the peer in every round, while the machine's speed drifts by half
    peer = [6.0 + 0.3 * (i % 5) for i in range(12)]
    met = paired_by_round(ran(*(p * (0.65 + 0.01 * (i % 4)) for i, p in enumerate(peer))), ran(*peer))
    assert met["status"] == "met" and met["interval95"][1] <= 0.7 and len(met["per_round"]) == 12
    missed = paired_by_round(ran(*(p * 0.74 for p in peer)), ran(*peer))
    assert missed["status"] == "not met" and missed["median"] == pytest.approx(0.74)
    straddles = paired_by_round(ran(*(p * (0.66 + 0.08 * (i % 2)) for i, p in enumerate(peer))), ran(*peer))
    assert straddles["status"] == "not resolved"
    few = paired_by_round(ran(4.0, 4.1), ran(6.5, 6.6))
    assert few["status"] == "not resolved"  # below 10 rounds: no verdict
    ten = [6.0 + 0.1 * i for i in range(10)]
    assert paired_by_round(ran(*(p * 0.6 for p in ten)), ran(*ten))["status"] == "met"  # from 10 on
    assert paired_by_round(ran(*(p * 0.6 for p in ten[:9])), ran(*ten[:9]))["status"] == "not resolved"
    assert paired_by_round({"wall_seconds": {}}, ran(6.0)) is None  # a record from before


@pytest.mark.unit
def test_bench_startup_rounds_run_each_contender_before_each_other_as_often_as_after():
    from itertools import permutations

    from benchmarks.startup import round_order

    for names in (["ddpkit", "torchrun"], ["ddpkit", "torchrun", "accelerate", "fabric"]):
        orders = [round_order(names, r) for r in range(2 * len(names))]
        assert all(sorted(o) == sorted(names) for o in orders)
        assert sorted(o[0] for o in orders) == sorted(names * 2)  # each first as often
        for a, b in permutations(names, 2):
            before = sum(o.index(a) < o.index(b) for o in orders)
            assert before == len(orders) // 2, (a, b)


@pytest.mark.unit
@pytest.mark.parametrize("failures", [1, 2])
def test_bench_startup_runs_a_failed_peer_once_more_and_skips_it_after_a_second_failure(monkeypatch, failures):
    from benchmarks import startup

    calls = []

    def run_once(name, epochs, tmp):
        calls.append(name)
        if name == "torchrun" and calls.count("torchrun") <= failures:
            raise RuntimeError(f"torchrun exited with 1 (failure {calls.count('torchrun')})")
        return {"seconds": 1.0, "test_accuracy": 1.0}

    monkeypatch.setattr(startup, "run_once", run_once)
    skipped, retried = {}, {}
    runs = startup._rounds(["ddpkit", "torchrun"], 1, 2, 0, skipped, retried)
    assert retried == {"torchrun": ["torchrun exited with 1 (failure 1)"]}
    if failures == 1:  # the second try ran, and every round after it
        assert not skipped and len(runs["torchrun"]) == 2 and len(runs["ddpkit"]) == 2
    else:
        assert skipped == {"torchrun": "failed: torchrun exited with 1 (failure 2)"} and "torchrun" not in runs
        assert len(runs["ddpkit"]) == 2
