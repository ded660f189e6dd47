"""`strategy`: unwrapping a wrapped model, which strategy runs where, DDP keeping the ranks'
weights in step, and DDP's tuning options leaving the weights as they were (or, with the fp16
compression hook, close)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.strategy import unwrap
from tests import workers


@pytest.mark.unit
def test_unwrap_strips_wrappers():
    bare = nn.Linear(2, 2)
    assert unwrap(nn.DataParallel(bare)) is bare
    compiled = torch.compile(bare)
    assert unwrap(compiled) is bare
    assert not any(k.startswith("_orig_mod.") for k in unwrap(compiled).state_dict())


@pytest.mark.unit
def test_single_strategy_on_several_processes_is_refused():
    from ddpkit.strategy import resolve_name

    assert resolve_name("single", 1, torch.device("cpu")) == "single"
    with pytest.raises(ValueError, match="unsynchronized"):
        resolve_name("single", 2, torch.device("cpu"))


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_ranks_hold_identical_weights(nproc):
    out = ddpkit.launch(workers.train_steps, steps=4, global_batch=12, nproc=nproc)
    assert sorted(out) == list(range(nproc))
    assert {r["world"] for r in out.values()} == {nproc}
    assert {r["strategy"] for r in out.values()} == {"ddp"}
    assert {r["batch"] for r in out.values()} == {12 // nproc}  # the global batch is split
    # Ranks built different initial weights; DDP broadcast rank 0's, then kept them in step.
    for r in range(1, nproc):
        assert torch.equal(out[r]["start"], out[0]["start"])
        assert torch.equal(out[r]["end"], out[0]["end"])
    assert not torch.equal(out[0]["start"], out[0]["end"])  # training did move them


@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [{"gradient_as_bucket_view": True}, {"static_graph": True}, {"bucket_cap_mb": 0.001}],
    ids=["bucket-view", "static-graph", "tiny-buckets"],
)
def test_ddp_tuning_options_keep_the_weights_bit_identical(options):
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    tuned = ddpkit.launch(workers.ddp_options_weights, options, nproc=2, device="cpu")
    assert torch.equal(base[0], base[1]) and torch.equal(tuned[0], tuned[1])
    assert torch.equal(tuned[0], base[0])


@pytest.mark.distributed
def test_fp16_compression_hook_trains_close_to_full_precision():
    base = ddpkit.launch(workers.ddp_options_weights, {}, nproc=2, device="cpu")
    fp16 = ddpkit.launch(workers.ddp_options_weights, {"comm_hook": "fp16"}, nproc=2, device="cpu")
    assert torch.equal(fp16[0], fp16[1])  # every rank applies the same decompressed gradients
    diff = (fp16[0] - base[0]).abs().max().item()
    assert 0 < diff < 1e-2  # rounded to 16 bits on the wire, so close but not equal


def compiled_ddp_run(compile: bool | dict, folder: str) -> dict:
    """Two DDP steps of the default CNN (a bare nn.Sequential: the model that compiled nothing when
    torch.compile went around DDP) with a dropout before its last layer (whose draw, in the
    Sequential's loop, left it all uncompiled when compiled whole), 32 samples per rank and
    forward (a size at which torch 2.13's inductor, left to its defaults, zeroed the
    convolutions' gradients), a checkpoint, and what this worker's dynamo counted."""
    from torch._dynamo.utils import counters

    from ddpkit import data
    from ddpkit.models import small_cnn
    from ddpkit.strategy import compiled_graphs

    # A forked worker inherits this test process's dynamo caches and counts: start from none,
    # as a worker of `ddpkit train` does (its launcher never compiles).
    torch._dynamo.reset()
    counters.clear()
    with ddpkit.Runtime(device="cpu", seed=3, compile=compile) as rt:
        layers = list(small_cnn((1, 8, 8), 10))
        model = torch.nn.Sequential(*layers[:-1], torch.nn.Dropout(0.2), layers[-1])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        for x, y in rt.loader(data.synthetic((1, 8, 8), 128, 10, seed=2).train, batch_size=64):
            rt.backward(torch.nn.functional.cross_entropy(model(x), y))
            rt.step(opt)
        path = f"{folder}/compiled-{bool(compile)}.pt"
        rt.save(path, model=model)
        return {
            "graphs": compiled_graphs(),
            "under_ddp": rt.ddp is not None,
            "keys": list(torch.load(path, weights_only=True)["model"]),
            "weights": workers.flat_params(model),
        }


@pytest.mark.distributed
@pytest.mark.slow
def test_compile_under_ddp_produces_graphs_and_keeps_the_results(tmp_path, capfd):
    compiled = ddpkit.launch(compiled_ddp_run, True, str(tmp_path), nproc=2, device="cpu")
    assert "torch.compile produced no graph" not in capfd.readouterr().err
    eager = ddpkit.launch(compiled_ddp_run, False, str(tmp_path), nproc=2, device="cpu")
    assert all(r["graphs"] > 0 and r["under_ddp"] for r in compiled.values())
    assert all(r["graphs"] == 0 for r in eager.values())
    assert compiled[0]["keys"] == eager[0]["keys"] == [f"{i}.{p}" for i in (0, 2, 7, 10) for p in ("weight", "bias")]
    assert torch.equal(compiled[0]["weights"], compiled[1]["weights"])  # DDP kept the ranks in step
    assert torch.allclose(
        compiled[0]["weights"], eager[0]["weights"], atol=1e-5
    )  # inductor's kernels round differently


@pytest.mark.distributed
def test_compile_that_produces_no_graph_is_one_warning_from_rank_0(tmp_path, capfd):
    # torch.compile(..., disable=True) hands the model back as it is: nothing is compiled.
    out = ddpkit.launch(compiled_ddp_run, {"disable": True}, str(tmp_path), nproc=2, device="cpu")
    assert all(r["graphs"] == 0 for r in out.values())
    warnings = [line for line in capfd.readouterr().err.splitlines() if "torch.compile produced no graph" in line]
    assert len(warnings) == 1 and "warning" in warnings[0]


@pytest.mark.unit
def test_compile_with_buckets_smaller_than_ddps_first_is_a_usage_error():
    from ddpkit.errors import UsageError

    # torch's DDPOptimizer asserts on them; the plan and Runtime say which flags instead.
    with pytest.raises(UsageError, match=r"--bucket-cap-mb 0.5 with --compile"):
        ddpkit.Runtime(device="cpu", compile=True, ddp={"bucket_cap_mb": 0.5})
    ddpkit.Runtime(device="cpu", compile=True, ddp={"bucket_cap_mb": 1}).close()
    from ddpkit.trainer import TrainConfig, resolve

    with pytest.raises(UsageError, match=r"--bucket-cap-mb 0.5 with --compile"):  # ddpkit train: exit 2
        resolve(TrainConfig(device="cpu", compile=True, bucket_cap_mb=0.5))


@pytest.mark.unit
def test_fsdp_runs_as_single_on_one_process_and_refuses_what_it_does_not_support():
    from ddpkit.errors import UsageError
    from ddpkit.strategy import resolve_name
    from ddpkit.trainer import TrainConfig, resolve

    assert resolve_name("fsdp", 1, torch.device("cpu")) == "single"
    assert resolve_name("fsdp", 2, torch.device("cpu")) == "fsdp"
    with pytest.raises(UsageError, match="--fsdp-reduce-dtype: unknown value 'fp8'"):
        ddpkit.Runtime("fsdp", device="cpu", fsdp={"reduce_dtype": "fp8"})
    with pytest.raises(UsageError, match="--fsdp-cpu-offload applies to --strategy fsdp only"):
        resolve(TrainConfig(device="cpu", fsdp_cpu_offload=True))  # not silently ignored under ddp
    assert resolve(TrainConfig(device="cpu", strategy="fsdp", fsdp_reduce_dtype="bf16")).fsdp.reduce_dtype == "bf16"
    resolve(TrainConfig(device="cpu", strategy="fsdp", model="resnet18", data="synthetic"))  # BatchNorm: as ddp
    with pytest.raises(UsageError, match="does not support SyncBatchNorm"):
        from ddpkit.strategy.fsdp import check_model

        check_model(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_fsdp_starts_bit_for_bit_from_the_one_process_build_which_only_rank_0_makes(nproc):
    one = workers.fsdp_built_from_rank0()  # one process: fsdp runs as single, the model built in full
    assert one["strategy"] == "single" and one["built_on"] == ["cpu"]
    out = ddpkit.launch(workers.fsdp_built_from_rank0, nproc=nproc, device="cpu")
    assert out[0]["built_on"] == ["cpu"]
    for r in range(1, nproc):
        assert out[r]["built_on"] == ["meta"]  # no values, no memory: never a full copy on these ranks
    state = out[0]["state"]  # gathered from every rank's shards after setup
    assert list(state) == list(one["state"])  # parameters and the persistent buffer
    for key, value in one["state"].items():
        assert torch.equal(state[key], value), key
    for r in out.values():
        assert torch.equal(r["shift"], one["shift"])  # the non-persistent buffer, from rank 0
        # AdamW built on the meta-built model before setup trains the shards
        torch.testing.assert_close(r["params"], one["params"], rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_fsdp_builds_in_full_what_meta_cannot_build_and_refuses_a_model_with_no_values_on_rank_0():
    out = ddpkit.launch(workers.fsdp_meta_edge_cases, nproc=2, device="cpu")
    assert out[0]["built_on"] == out[1]["built_on"] == ["cpu"]  # .item() in the constructor: no meta
    torch.manual_seed(3)  # the Runtime's seed
    built = workers.flat_params(workers.SizedByATensor())
    assert torch.equal(out[0]["params"], built)
    for r in out.values():  # every rank raises, none waits for rank 0's values
        assert "rank 0 must build the model for real" in r["refused"]


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_on_cpu_returns_gathered_parameters_to_the_system_unless_the_user_set_the_allocator(monkeypatch):
    held = ddpkit.launch(workers.fsdp_training_memory, nproc=2, device="cpu")
    assert {r["allocator"] for r in held.values()} == {"mmap threshold 1048576 bytes (mallopt)"}
    # A setting of the user's own is left alone; glibc's default then keeps freed blocks.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(32 * 2**20))
    kept = ddpkit.launch(workers.fsdp_training_memory, nproc=2, device="cpu")
    assert {r["allocator"] for r in kept.values()} == {
        "left as the environment sets it (MALLOC_MMAP_THRESHOLD_=33554432)"
    }
    for r in range(2):  # measured: 155 MiB against 570-590 MiB
        assert held[r]["growth_mib"] < 0.5 * kept[r]["growth_mib"], (held[r], kept[r])


@pytest.mark.unit
def test_a_model_on_the_meta_device_is_refused_where_nothing_fills_it():
    from ddpkit.errors import UsageError

    with torch.device("meta"):
        model = workers.toy_model()
    with ddpkit.Runtime("ddp", device="cpu") as rt, pytest.raises(UsageError, match="meta device"):
        rt.setup(model)


@pytest.mark.distributed
def test_fsdp_accumulation_skips_the_reduce_scatter_until_the_last_micro_batch():
    out = ddpkit.launch(workers.fsdp_sync_switch, nproc=2, device="cpu")
    for r in out.values():
        assert r["dtensor_params"]  # sharded in place; the optimizer built before setup was re-pointed
        # 6 samples per rank in micro-batches of 2: no reduction after the first two backwards
        assert r["seen"] == [{"NoneType"}, {"NoneType"}, {"DTensor"}]


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_checkpoints_are_sharded_and_move_to_any_world_size_and_strategy(tmp_path):
    straight = workers.checkpoint_hop("", "single", "straight")["params"]
    # fsdp on 2 saves a directory: each rank its own shards, nothing gathered
    ddpkit.launch(workers.checkpoint_hop, str(tmp_path / "a"), "fsdp", "save", nproc=2, device="cpu")
    assert sorted(os.listdir(tmp_path / "a")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "checksums.json",
        "state.pt",
    ]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []
    # one process (bare model, plain AdamW) continues from it, and so does fsdp on 3 (uneven shards)
    continued = workers.checkpoint_hop(str(tmp_path / "a"), "single", "load")["params"]
    torch.testing.assert_close(continued, straight, rtol=0, atol=1e-6)
    out = ddpkit.launch(workers.checkpoint_hop, str(tmp_path / "a"), "fsdp", "load", nproc=3, device="cpu")
    for r in out.values():
        assert r["strategy"] == "fsdp"
        torch.testing.assert_close(r["params"], straight, rtol=0, atol=1e-6)
    # one process saves one file; fsdp on 3 continues from it
    workers.checkpoint_hop(str(tmp_path / "b.pt"), "single", "save")
    out = ddpkit.launch(workers.checkpoint_hop, str(tmp_path / "b.pt"), "fsdp", "load", nproc=3, device="cpu")
    for r in out.values():
        torch.testing.assert_close(r["params"], straight, rtol=0, atol=1e-6)


# bf16 rounds to 8 significant bits, in another order on another number of processes: after 8
# momentum-SGD steps of the toy MLP (lr 0.2, 5 samples per rank), fsdp on 2 differed from bf16
# on one process by 1.5e-3 at most (absolute; bf16 on one process differs from fp32 by 7.3e-3),
# and from ddp bf16 on 2 not at all (0.0; fp16 too, the skipped overflow step included).
BF16_ATOL = 5e-3


@pytest.mark.distributed
def test_fsdp_mixed_precision_is_ddps_autocast_keeps_fp32_shards_and_reduces_in_fp32_unless_asked():
    runs = {
        "bf16": {"strategy": "fsdp", "precision": "bf16"},
        "ddp-bf16": {"strategy": "ddp", "precision": "bf16"},
        "bf16-reduce-bf16": {"strategy": "fsdp", "precision": "bf16", "fsdp": {"reduce_dtype": "bf16"}},
        "fp16": {"strategy": "fsdp", "precision": "fp16", "steps": 30},
        "ddp-fp16": {"strategy": "ddp", "precision": "fp16", "steps": 30},
        "fp32": {"strategy": "fsdp"},
        "fp32-offload": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}},
    }
    runs = {name: {"steps": 8, "global_batch": 10, **kwargs} for name, kwargs in runs.items()}
    out = ddpkit.launch(workers.several_runs, runs, nproc=2, device="cpu")
    one = workers.invariant_steps(8, 10, precision="bf16")  # single, autocast
    for r in out.values():
        bf16 = r["bf16"]
        assert bf16["dtypes"] == {torch.float32}  # the sharded copy the optimizer steps
        assert bf16["loss"][1] < bf16["loss"][0] and all(map(math.isfinite, bf16["loss"]))
        torch.testing.assert_close(bf16["params"], one["params"], rtol=0, atol=BF16_ATOL)
        # Gradients reduce-scattered in fp32 are DDP's fp32 all-reduce of its autocast gradients.
        torch.testing.assert_close(bf16["params"], r["ddp-bf16"]["params"], rtol=0, atol=1e-6)
        assert (r["bf16-reduce-bf16"]["params"] - bf16["params"]).abs().max() > 0  # asked otherwise
        # fp16: on 2 processes a rank's gradient overflows once in 30 steps (so does DDP's): all skip
        fp16 = r["fp16"]
        assert fp16["scale"] == r["ddp-fp16"]["scale"] == 2.0**15
        torch.testing.assert_close(fp16["params"], r["ddp-fp16"]["params"], rtol=0, atol=1e-6)
        # CPU offload on a CPU device: the parameters are in host memory already
        assert r["fp32-offload"]["dtypes"] == {torch.float32}
        torch.testing.assert_close(r["fp32-offload"]["params"], r["fp32"]["params"], rtol=0, atol=0)


@pytest.mark.distributed
def test_fsdp_fp16_skips_the_step_on_every_rank_when_one_rank_shard_overflows():
    # torch's GradScaler on FSDP2's DTensor gradients: DTensor's handler for the inf check
    # all-reduces (max) what each rank found in its shard.
    out = ddpkit.launch(workers.fsdp_fp16_overflow_on_one_rank, nproc=2, device="cpu")
    for r in out.values():
        assert r["unchanged"] and r["scale"] == (2.0**16, 2.0**15)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_compiles_each_shard_unit_to_the_same_weights():
    # Compiling the sharded model from outside compiled nothing (torch 2.13); each unit's forward,
    # compiled before fully_shard, gives graphs (train, eval and the last batch's shapes).
    runs = {"eager": {"strategy": "fsdp"}, "compiled": {"strategy": "fsdp", "compile": True}}
    runs = {name: {"steps": 8, "global_batch": 10, **kwargs} for name, kwargs in runs.items()}
    out = ddpkit.launch(workers.several_runs, runs, nproc=2, device="cpu")
    for r in out.values():
        assert r["eager"]["graphs"] == 0 and r["compiled"]["graphs"] > 0
        torch.testing.assert_close(r["compiled"]["params"], r["eager"]["params"], rtol=0, atol=1e-6)


@pytest.mark.distributed
def test_fsdp_batchnorm_keeps_ddps_buffers_rank_0s_running_statistics_every_step():
    # DDP broadcasts rank 0's buffers before each training forward; fsdp does the same, so a
    # BatchNorm model trains as under ddp (statistics over each rank's share: see invariance.md).
    out = ddpkit.launch(workers.batchnorm_steps, nproc=2, device="cpu")
    for r in out.values():
        torch.testing.assert_close(r["fsdp"]["params"], r["ddp"]["params"], rtol=0, atol=1e-6)
        # each rank: rank 0's statistics before the last forward, plus its own last update
        torch.testing.assert_close(r["fsdp"]["buffers"], r["ddp"]["buffers"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0]["fsdp"]["own"], out[0]["fsdp"]["buffers"], rtol=0, atol=1e-6)
    # rank 1 on its own would hold other statistics: the broadcast is what made them rank 0's
    assert (out[1]["fsdp"]["own"] - out[1]["fsdp"]["buffers"]).abs().max() > 1e-3
    assert not torch.equal(out[0]["fsdp"]["buffers"], out[1]["fsdp"]["buffers"])  # its last own update


@pytest.mark.distributed
@pytest.mark.parametrize("leave", ["returning", "raising"])
def test_a_background_save_not_waited_for_is_whole_once_the_runtime_closes(tmp_path, leave):
    # close() waits for it before the process groups its write uses are torn down
    from ddpkit import checkpoint
    from ddpkit.checkpoint import shards
    from ddpkit.errors import WorkerFailed

    path = tmp_path / "ck"
    if leave == "raising":
        with pytest.raises(WorkerFailed, match="left with the save under way"):
            ddpkit.launch(workers.background_save_left, str(path), True, nproc=2, device="cpu")
    else:
        saved = ddpkit.launch(workers.background_save_left, str(path), False, nproc=2, device="cpu")[0]["params"]
    shards.verify(path)  # every file there, as written
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp directory left behind
    model = workers.wide_model()
    checkpoint.load_into(path, {"model": model})
    if leave == "returning":
        assert torch.equal(workers.flat_params(model), saved)
