"""`probe`: one trial on each rank: the ranks agree on the minimum when one runs out of memory,
another error fails the run without a hang, a failed step releases what it held, and CPU
refuses a size predicted to exceed the available memory."""

from __future__ import annotations

import functools
import gc
import json
import weakref

import pytest
import torch

import ddpkit
from ddpkit import tune
from ddpkit.core.dist import DistEnv
from ddpkit.errors import WorkerFailed
from ddpkit.tune import probe
from tests.conftest import run_cli


@pytest.mark.unit
def test_cpu_refuses_a_size_predicted_to_exceed_the_available_memory(monkeypatch):
    # Base 300 MiB, and 64 samples peaked at 400 (100 MiB per 64 samples): 1024 samples would
    # peak at 1,900 MiB, 1,500 more than now, on each of the 2 local ranks. (On Linux running
    # out of memory gives no exception to catch: the kernel's OOM killer ends the worker.)
    rank = type("Rt", (), {"env": DistEnv(local_world_size=2)})()
    stub = type("T", (), {"cuda": False, "sharded": False, "last_fit": (64, 400.0), "base_rss": 300.0, "rt": rank})()
    monkeypatch.setattr(probe, "rss_mib", lambda: 400.0)
    monkeypatch.setattr(probe, "available_mib", lambda: 3000.0)
    assert not tune.Tuner._predicted_too_big(stub, 512)  # 2 x 700 MiB <= 80% of 3,000
    assert tune.Tuner._predicted_too_big(stub, 1024)  # 2 x 1,500 MiB > 80% of 3,000
    stub.cuda = True
    assert not tune.Tuner._predicted_too_big(stub, 1024)  # on CUDA the allocator says so itself


SMALL = {
    "model": "cnn",
    "data": "digits",
    "in_shape": (1, 8, 8),
    "num_classes": 10,
    "device": "cpu",
    "steps": 1,
    "warmup": 0,
    "criterion": "largest",
    "timeout_s": 60.0,
}


def oom_above(rank: int, limit: int, this_rank: int, size: int) -> None:
    """Probe hook: this rank runs out of memory above `limit` samples, the way CUDA reports it."""
    if this_rank == rank and size > limit:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} samples (test)")


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_agree_on_the_minimum_when_one_rank_runs_out_of_memory(strategy):
    # fsdp: the hook fails before the step, where an out-of-memory verdict can still be agreed.
    settings = tune.Settings(start=1, max_batch=1024, strategy=strategy, **SMALL)
    out = ddpkit.launch(tune.worker, settings, functools.partial(oom_above, 1, 37), nproc=2, device="cpu")
    assert sorted(out) == [0, 1]
    for r in (0, 1):
        assert out[r]["strategy"] == strategy
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


GPT = {
    "model": "gpt",
    "data": "text",
    "in_shape": (16,),
    "num_classes": 256,
    "gpt_width": 16,
    "gpt_depth": 2,
    "gpt_heads": 2,
    **{k: v for k, v in SMALL.items() if k not in ("model", "data", "in_shape", "num_classes")},
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mesh,sizes",
    [
        ("dp=1,tp=2", [1, 2, 4, 8, 16, 12, 10, 9]),
        ("pp=2", [2, 4, 8, 16, 12, 10, 9]),  # 1f1b: one micro-batch per stage at least
    ],
)
def test_under_tp_and_pp_a_size_is_a_data_ranks_and_the_ranks_agree(mesh, sizes):
    # Rank 1 (a tensor-parallel rank; the pipeline's last stage) runs out of memory above 9.
    settings = tune.Settings(start=1, max_batch=16, mesh=mesh, strategy="tp" if "tp" in mesh else "pp", **GPT)
    out = ddpkit.launch(tune.worker, settings, functools.partial(oom_above, 1, 9), nproc=2, device="cpu")
    r = out[0]
    assert (r["mesh"], r["world_size"], r["data_ranks"]) == (mesh, 2, 1)
    assert [t["per_device_batch"] for t in r["trials"]] == sizes and r["trials"] == out[1]["trials"]
    assert r["per_device_batch"] == 9 and r["global_batch"] == 9  # both processes read the same 9
    assert all(t["global_batch"] == t["per_device_batch"] for t in r["trials"])
    assert all(t["samples_per_s"] > 0 for t in r["trials"] if t["fits"])
    assert sorted(out[1]["local_failures"]) == [10, 12, 16]


@pytest.mark.distributed
def test_an_error_other_than_out_of_memory_fails_the_run_without_a_hang():
    def boom(rank: int, size: int) -> None:
        if rank == 1 and size > 2:
            raise ValueError("not a memory problem")

    settings = tune.Settings(start=1, max_batch=16, **SMALL)
    with pytest.raises(WorkerFailed) as info:
        ddpkit.launch(tune.worker, settings, boom, nproc=2, device="cpu")
    assert info.value.rank == 1 and "not a memory problem" in str(info.value)


@pytest.mark.unit
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


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
def test_real_cuda_out_of_memory_is_caught_and_bisected(tmp_path):
    # An MLP on 12 MiB inputs: a few thousand samples fill any GPU, and the search must come
    # back from real out-of-memory errors to bisect.
    path = tmp_path / "r.json"
    proc = run_cli(
        "find-batch-size",
        "--device",
        "cuda",
        "--nproc",
        "1",
        "--model",
        "mlp",
        "--data",
        "synthetic",
        "--synthetic-shape",
        "3,1024,1024",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        str(path),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(path.read_text())
    assert r["criterion"] == "largest that fits"
    bad = [t["per_device_batch"] for t in r["trials"] if not t["fits"]]
    assert bad and r["per_device_batch"] + 1 == min(bad)
    assert r["gpu"] and r["peak_memory_measure"] == "torch.cuda.max_memory_allocated"


@pytest.mark.unit
def test_a_searched_gpt_is_built_in_the_shape_asked_as_train_builds_it():
    from ddpkit import models
    from ddpkit.tune.plan import Settings

    shape = {"gpt_width": 16, "gpt_depth": 2, "gpt_heads": 4, "gpt_style": "llama", "gpt_kv_heads": 2, "gpt_hidden": 24}
    s = Settings(model="gpt", data="text", in_shape=(16,), num_classes=256, **shape)
    model = models.build(s.model, s.in_shape, s.num_classes, **s.model_options())  # as the probe builds it
    counted = models.gpt_parameters(16, 256, 16, 2, style="llama", heads=4, kv_heads=2, hidden=24)
    assert sum(p.numel() for p in model.parameters()) == counted
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())  # RMSNorm: llama's
