"""`ddpkit find-batch-size`: the search logic, out-of-memory on one rank of two real gloo
processes, the command end to end on 2 CPU processes, and bad input."""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import weakref

import pytest
import torch

import ddpkit
from ddpkit import tune
from ddpkit.tune import probe
from ddpkit.tune.output import nothing_fits
from ddpkit.dist import DistEnv
from ddpkit.errors import WorkerFailed

from .conftest import run_cli

# -- the search, with a trial that fits up to a threshold ---------------------------------------


def _fake_trial(fits_up_to: int, log: list[int]):
    def trial(size: int, phase: str) -> tune.Trial:
        log.append(size)
        ok = size <= fits_up_to
        return tune.Trial(size, 2 * size, ok, samples_per_s=float(size) if ok else None, phase=phase)

    return trial


@pytest.mark.parametrize("start", [1, 8])
@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 37, 64, 100, 999, 1000, 5000])
def test_search_finds_the_exact_boundary(start, threshold):
    log: list[int] = []
    trials = tune.search(_fake_trial(threshold, log), start, max_batch=1000)
    assert tune.largest_fit(trials).per_device_batch == min(threshold, 1000)
    doubling = [t.per_device_batch for t in trials if t.phase == "doubling"]
    assert doubling[0] == start and all(b == min(2 * a, 1000) for a, b in itertools.pairwise(doubling))
    good = max([b for b in doubling if b <= threshold], default=0)
    assert all(good < t.per_device_batch < doubling[-1] for t in trials if t.phase == "bisect")
    assert len(set(log)) == len(log)  # no size tried twice


def test_search_when_nothing_fits_and_from_a_start_too_large():
    assert tune.largest_fit(tune.search(_fake_trial(0, []), 4, 64)) is None
    log: list[int] = []
    trials = tune.search(_fake_trial(5, log), 16, 64)
    assert log == [16, 8, 4, 6, 5] and tune.largest_fit(trials).per_device_batch == 5
    log = []  # BatchNorm models start at 2 and never try 1
    assert tune.largest_fit(tune.search(_fake_trial(1, log), 2, 64, smallest=2)) is None and log == [2]
    log = []
    assert tune.largest_fit(tune.search(_fake_trial(2, log), 8, 64, smallest=2)).per_device_batch == 2
    assert log == [8, 4, 2, 3]


def test_knee_is_the_smallest_size_reaching_90_percent_of_the_best():
    rates = {1: 100.0, 2: 180.0, 4: 700.0, 8: 905.0, 16: 1000.0, 32: 960.0}
    trials = [tune.Trial(b, b, True, samples_per_s=r) for b, r in rates.items()] + [tune.Trial(64, 64, False)]
    assert tune.knee(trials).per_device_batch == 8  # 905 >= 0.9 * 1000; 700 is not
    assert tune.pick(trials, "largest").per_device_batch == 32
    # Plateau: two sizes in a row without 5% gain over the best before them stop the doubling.
    log: list[int] = []
    curve = {1: 10.0, 2: 20.0, 4: 40.0, 8: 41.0, 16: 40.0, 32: 90.0}
    trials = tune.search(lambda b, ph: log.append(b) or tune.Trial(b, b, True, samples_per_s=curve[b]), 1, 32,
                         plateau=2)
    assert log == [1, 2, 4, 8, 16]


def test_cpu_refuses_a_size_predicted_to_exceed_the_available_memory(monkeypatch):
    # Base 300 MiB, and 64 samples peaked at 400 (100 MiB per 64 samples): 1024 samples would
    # peak at 1,900 MiB, 1,500 more than now, on each of the 2 local ranks. (On Linux running
    # out of memory gives no exception to catch: the kernel's OOM killer ends the worker.)
    rank = type("Rt", (), {"env": DistEnv(local_world_size=2)})()
    stub = type("T", (), {"cuda": False, "last_fit": (64, 400.0), "base_rss": 300.0, "rt": rank})()
    monkeypatch.setattr(probe, "rss_mib", lambda: 400.0)
    monkeypatch.setattr(probe, "available_mib", lambda: 3000.0)
    assert not tune.Tuner._predicted_too_big(stub, 512)  # 2 x 700 MiB <= 80% of 3,000
    assert tune.Tuner._predicted_too_big(stub, 1024)  # 2 x 1,500 MiB > 80% of 3,000
    stub.cuda = True
    assert not tune.Tuner._predicted_too_big(stub, 1024)  # on CUDA the allocator says so itself


def test_nothing_fits_names_the_size_and_the_ranks():
    trials = tune.search(_fake_trial(0, []), 2, 8)
    for t in trials:
        t.failed_ranks, t.reason = [1], "out of memory"
    r = tune.summarize(trials, tune.Settings(start=2, max_batch=8), "largest", 2, "cuda")
    assert r["per_device_batch"] is None and r["global_batch"] is None
    assert nothing_fits(r) == "no per-device batch fits on every rank: even 1 did not (out of memory on rank 1)"


# -- real trials: out-of-memory on one rank of two ----------------------------------------------

SMALL = {"model": "cnn", "data": "digits", "in_shape": (1, 8, 8), "num_classes": 10, "device": "cpu", "steps": 1,
         "warmup": 0, "criterion": "largest", "timeout_s": 60.0}


def oom_above(rank: int, limit: int, this_rank: int, size: int) -> None:
    """Probe hook: this rank runs out of memory above `limit` samples, the way CUDA reports it."""
    if this_rank == rank and size > limit:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples (test)")


def test_ranks_agree_on_the_minimum_when_one_rank_runs_out_of_memory():
    settings = tune.Settings(start=1, max_batch=1024, **SMALL)
    out = ddpkit.launch(tune.worker, settings, functools.partial(oom_above, 1, 37), nproc=2, device="cpu")
    assert sorted(out) == [0, 1]
    for r in (0, 1):
        assert out[r]["per_device_batch"] == 37 and out[r]["global_batch"] == 74
        assert out[r]["criterion"] == "largest that fits" and out[r]["world_size"] == 2
    assert out[0]["trials"] == out[1]["trials"]  # the same verdicts, times and memory on both
    sizes = [t["per_device_batch"] for t in out[0]["trials"]]
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    failed = {t["per_device_batch"]: t["failed_ranks"] for t in out[0]["trials"] if not t["fits"]}
    assert failed == {64: [1], 48: [1], 40: [1], 38: [1]}
    assert all(t["reason"] == "out of memory" for t in out[0]["trials"] if not t["fits"])
    assert out[0]["local_failures"] == {} and sorted(out[1]["local_failures"]) == [38, 40, 48, 64]
    assert all(t["samples_per_s"] > 0 for t in out[0]["trials"] if t["fits"])


def test_an_error_other_than_out_of_memory_fails_the_run_without_a_hang():
    def boom(rank: int, size: int) -> None:
        if rank == 1 and size > 2:
            raise ValueError("not a memory problem")

    settings = tune.Settings(start=1, max_batch=16, **SMALL)
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(tune.worker, settings, boom, nproc=2, device="cpu")
    assert info.value.rank == 1 and "not a memory problem" in str(info.value)


def test_out_of_memory_releases_what_the_failed_step_held():
    held: list[weakref.ref] = []

    def allocate_then_fail(rank: int, size: int) -> None:
        block = torch.empty(size, 1024)  # what a forward would hold when the allocator gives up
        held.append(weakref.ref(block))
        if size > 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate ... (test)")

    result = tune.worker(tune.Settings(start=1, max_batch=64, **SMALL), allocate_then_fail)
    assert result["per_device_batch"] == 4
    gc.collect()
    assert held and all(ref() is None for ref in held)  # the traceback kept no tensor alive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
def test_real_cuda_out_of_memory_is_caught_and_bisected(tmp_path):
    # An MLP on 12 MiB inputs: a few thousand samples fill any GPU, and the search must come
    # back from real out-of-memory errors to bisect.
    path = tmp_path / "r.json"
    proc = run_cli("find-batch-size", "--device", "cuda", "--nproc", "1", "--model", "mlp", "--data", "synthetic",
                   "--synthetic-shape", "3,1024,1024", "--steps", "2", "--warmup", "1", "--json", str(path),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(path.read_text())
    assert r["criterion"] == "largest that fits"
    bad = [t["per_device_batch"] for t in r["trials"] if not t["fits"]]
    assert bad and r["per_device_batch"] + 1 == min(bad)
    assert r["gpu"] and r["peak_memory_measure"] == "torch.cuda.max_memory_allocated"


# -- the command ---------------------------------------------------------------------------------


def test_cli_two_processes_json_png_and_the_knee(tmp_path):
    json_path, png = tmp_path / "fbs.json", tmp_path / "fbs.png"
    proc = run_cli("find-batch-size", "--nproc", "2", "--device", "cpu", "--max-batch", "64", "--steps", "2",
                   "--warmup", "1", "--plateau", "0", "--json", str(json_path), "--plot", str(png), timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    r = json.loads(json_path.read_text())
    assert r["world_size"] == 2 and r["criterion"] == "knee" and r["knee_fraction"] == 0.9
    assert [t["per_device_batch"] for t in r["trials"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(t["fits"] and t["global_batch"] == 2 * t["per_device_batch"] for t in r["trials"])
    best = max(t["samples_per_s"] for t in r["trials"])
    knee = min(t["per_device_batch"] for t in r["trials"] if t["samples_per_s"] >= 0.9 * best)
    assert r["per_device_batch"] == knee and r["global_batch"] == 2 * knee
    assert r["largest_fitting_per_device_batch"] == 64 and r["search_stopped_by"] == "--max-batch"
    assert r["versions"]["torch"] == torch.__version__ and r["device"] == "cpu"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"use --batch-size {2 * knee} (per device {knee})" in proc.stdout
    assert proc.stdout.count("per-device   global") == 1  # one table, from rank 0 only


@pytest.mark.parametrize("args", [
    ["--max-batch", "0"],
    ["--start", "100", "--max-batch", "10"],
    ["--model", "nope"],
    ["--data", "synthetic", "--synthetic-shape", "3,x"],
    ["--steps", "0"],
    ["--nproc", "two"],
    ["--plot", "curve.jpg"],
    ["--json", "/dev/null/r.json"],
], ids=["max-batch", "start", "model", "shape", "steps", "nproc", "plot", "json"])
def test_bad_input_exits_2_with_one_line(args, tmp_path):
    proc = run_cli("find-batch-size", "--device", "cpu", *args, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit find-batch-size: error:"), proc.stderr
    assert not os.listdir(tmp_path)  # nothing written
