"""Meshes: the layout of a job's processes (`--mesh dp=2,tp=2`, `Runtime(mesh=...)`), the
strategies that run on them (hsdp, tp), and ddpkit's promises on each.

The distributed tests share three jobs: one of 4 processes runs every 4-process layout and the
first two legs of the resume chain, one of 2 processes its third leg, and one of 2 processes the
2-process layouts and its last leg; the test process itself is the one-process run and the
chain's fourth leg."""

from __future__ import annotations

import os
import re

import pytest
import torch

import ddpkit
from ddpkit import strategy
from ddpkit.errors import UsageError
from ddpkit.strategy import MeshSpec
from tests import workers_mesh
from tests.conftest import run_cli
from tests.test_runtime import WORLD_SIZE_ATOL


def fails_with_usage(proc, message: str) -> None:
    """Exit 2 and one line on stderr, holding `message`, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit train: error: ") and message in lines[0], lines


# -- the mesh: parsed, checked, and where each rank sits ----------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "text,sizes",
    [
        ("dp=2,tp=2", (("dp", 2), ("tp", 2))),
        (" tp = 4 ", (("tp", 4),)),
        ("tp=2,replicate=3", (("replicate", 3), ("tp", 2))),  # outermost first, whatever the order given
        ({"dp": 2, "replicate": 2}, (("replicate", 2), ("dp", 2))),
    ],
)
def test_a_mesh_reads_as_named_sizes_outermost_first(text, sizes):
    spec = MeshSpec.parse(text)
    assert spec.sizes == sizes
    assert MeshSpec.parse(str(spec)) == spec  # its text reads back as itself


@pytest.mark.unit
@pytest.mark.parametrize(
    "value,message",
    [
        ("dp=2;tp=2", "name=size pairs"),
        ("dp=2,tp=", "name=size pairs"),
        ("", "name=size pairs"),
        ("cp=2,dp=2", "unknown dimension 'cp'"),
        ("dp=2,dp=2", "dp is named twice"),
        ("dp=0", "dp=0"),
        ("tp=-2", "tp=-2"),
        ({"tp": 2.5}, "tp=2.5"),
        ({"tp": True}, "tp=True"),
        ({}, "no dimension"),
        (4, "expected a string"),
    ],
)
def test_a_bad_mesh_is_one_usage_error_naming_it(value, message):
    with pytest.raises(UsageError, match=message):
        MeshSpec.parse(value)


@pytest.mark.unit
def test_ranks_sit_row_major_and_tp_neighbours_share_their_samples():
    spec = MeshSpec.parse("replicate=2,dp=2,tp=2")
    assert spec.processes == 8 and spec.data_size == 4
    assert [spec.coordinates(r) for r in (0, 1, 2, 5, 7)] == [
        {"replicate": 0, "dp": 0, "tp": 0},
        {"replicate": 0, "dp": 0, "tp": 1},  # rank r and r + 1: one tp group (one machine)
        {"replicate": 0, "dp": 1, "tp": 0},
        {"replicate": 1, "dp": 0, "tp": 1},
        {"replicate": 1, "dp": 1, "tp": 1},
    ]
    assert [spec.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    layout = strategy.Layout(spec)
    assert [layout.leads(r) for r in range(4)] == [True, False, True, False]
    assert layout.where(5) == "replicate=1,dp=0,tp=1"
    assert strategy.Layout.plain(4).where(3) == ""  # a plain layout: the rank says it all
    with pytest.raises(UsageError, match=r"multiply to 8 processes, but the job has 4 \(--nproc 8"):
        spec.check_processes(4)


@pytest.mark.unit
@pytest.mark.parametrize(
    "asked,mesh,runs",
    [
        ("ddp", "dp=2,tp=2", "tp"),  # the mesh names tp: tp runs
        ("ddp", "replicate=2,dp=2", "hsdp"),
        ("ddp", "dp=4", "ddp"),
        ("fsdp", "dp=4", "fsdp"),
        ("tp", "tp=4", "tp"),
        ("hsdp", "dp=4", "hsdp"),  # one replica: fsdp's sharding under hsdp's name
        ("ddp", "pp=2", "pp"),
        ("ddp", "dp=2,pp=2", "pp"),  # each stage replicated over dp
        ("ddp", "tp=2,pp=2", "pp"),  # each stage's layers split over tp
    ],
)
def test_the_mesh_picks_the_strategy_it_names(asked, mesh, runs):
    assert strategy.for_mesh(asked, MeshSpec.parse(mesh)) == runs


@pytest.mark.unit
@pytest.mark.parametrize(
    "asked,mesh,message",
    [
        ("fsdp", "dp=2,tp=2", "--strategy fsdp runs on dp only; tp needs --strategy tp"),
        ("hsdp", "dp=2,tp=2", "--strategy hsdp runs on replicate, dp only; tp needs --strategy tp"),
        ("tp", "replicate=2,dp=2", "--strategy tp runs on dp, tp only; replicate needs --strategy hsdp"),
        ("ddp", "replicate=2,tp=2", "no strategy runs on replicate and tp together yet"),
        ("single", "tp=2", "--strategy single runs on dp only"),
        ("fsdp", "pp=2", "--strategy fsdp runs on dp only; pp needs --strategy pp"),
        ("pp", "replicate=2,pp=2", "no strategy runs on pp and replicate together yet"),
        ("tp", "dp=2,tp=2,pp=2", "--strategy tp runs on dp, tp only; pp needs --strategy pp"),
    ],
)
def test_a_mesh_the_strategy_does_not_run_on_is_refused(asked, mesh, message):
    with pytest.raises(UsageError, match=message):
        strategy.for_mesh(asked, MeshSpec.parse(mesh))


@pytest.mark.unit
def test_default_meshes_put_tp_and_shards_on_one_machine():
    hsdp, tp = strategy.REGISTRY["hsdp"], strategy.REGISTRY["tp"]
    assert str(hsdp.default_mesh(8, 4)) == "replicate=2,dp=4"  # one replica per machine
    assert str(tp.default_mesh(8, 4)) == "dp=2,tp=4"  # one tp group per machine
    assert str(tp.default_mesh(2, 2)) == "dp=1,tp=2"


@pytest.mark.unit
def test_a_model_without_a_tp_plan_is_refused_with_the_way_to_give_one():
    from ddpkit.strategy.tp import plan_for

    with pytest.raises(UsageError, match=r"has no tensor-parallel plan; pass Runtime\(tp_plan=...\)"):
        plan_for(torch.nn.Linear(4, 4), None, 2)
    with pytest.raises(UsageError, match="tp_plan: expected a dict"):
        plan_for(torch.nn.Linear(4, 4), ["not", "a", "plan"], 2)
    own = workers_mesh.mesh_gpt()
    assert "block*.attn.q" in plan_for(own, None, 4)  # the model's own plan wins
    with pytest.raises(UsageError, match="its 4 heads and 256 tokens must be multiples of 3"):
        plan_for(own, None, 3)


@pytest.mark.unit
@pytest.mark.parametrize(
    "settings,message",
    [
        ({"mesh": "dp=2,tp=2"}, "multiply to 4 processes, but the job has 1"),
        ({"mesh": "dp=2,tp=x", "nproc": "4"}, "--mesh 'dp=2,tp=x': expected name=size pairs"),
        ({"mesh": "tp=3", "nproc": "3"}, "--gpt-heads 4 and the 256 tokens must be multiples of 3"),
        ({"mesh": "tp=3", "nproc": "3", "gpt_heads": 3, "gpt_width": 12}, "the 256 tokens must be multiples of 3"),
        ({"mesh": "dp=2,tp=2", "nproc": "4", "batch_size": 1}, "smaller than the 2 data ranks of --mesh dp=2,tp=2"),
        ({"mesh": "dp=2,tp=2", "nproc": "4", "strategy": "fsdp"}, "tp needs --strategy tp"),
        ({"mesh": "dp=2", "nproc": "2", "nnodes": "1:2", "master_addr": "127.0.0.1"}, "a fixed number of machines"),
        ({"model": "cnn", "data": "digits", "strategy": "tp", "nproc": "2"}, "cnn has no tensor-parallel plan"),
        ({"mesh": "pp=2", "nproc": "2", "precision": "fp16"}, "fp16's loss scaling does not run through a pipeline"),
        (
            {"mesh": "tp=2", "nproc": "2", "precision": "fp16"},
            "fp16's loss scaling cannot unscale tp's split and whole",
        ),
        ({"mesh": "pp=2,tp=3", "nproc": "6"}, "--gpt-heads 4 and the 256 tokens must be multiples of 3"),
        ({"mesh": "pp=2", "nproc": "2", "compile": True}, "--compile under a pipeline is not supported yet"),
        ({"mesh": "pp=4", "nproc": "4", "gpt_depth": 1}, "the model has 3 children to split into 4 stages"),
        ({"mesh": "pp=2", "nproc": "2", "batch_size": 1}, "a step's 1 sample(s) per data rank cannot fill 2"),
        ({"mesh": "pp=2", "nproc": "2", "micro_batch_size": 64}, "gives 1 micro-batch(es) per step for 2 pipeline"),
        (
            {"mesh": "pp=2", "nproc": "2", "pp_schedule": "zb"},
            "--pp-schedule: unknown value 'zb'; choose from 1f1b, gpipe",
        ),
    ],
)
def test_the_plan_refuses_a_bad_mesh_before_anything_starts(tmp_path, settings, message):
    from ddpkit.trainer import TrainConfig, resolve

    cfg = {"model": "gpt", "data": "text", "device": "cpu", "out": str(tmp_path / "out"), **settings}
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(TrainConfig(**cfg))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.unit
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_the_default_micro_batches_fill_every_stage(stages):
    for share in range(stages, 70):
        size = strategy.micro_batch_size(share, stages)
        assert -(-share // size) >= stages, (share, size)  # 1f1b: at least one micro-batch per stage
        larger = [m for m in range(size + 1, -(-share // stages) + 1) if -(-share // m) >= stages]
        assert not larger, (share, size, larger)  # and none larger up to an equal cut would do


@pytest.mark.unit
def test_the_trainer_cuts_six_samples_into_enough_micro_batches_for_four_stages(tmp_path):
    from ddpkit.trainer import TrainConfig, resolve

    # Equal pieces of 2 would make 3 micro-batches, and 1f1b could not start on 4 stages.
    cfg = TrainConfig(model="gpt", data="text", device="cpu", mesh="pp=4", nproc="4", batch_size=6, out=str(tmp_path))
    assert resolve(cfg).cfg.micro_batch_size == 1


OWN_MODELS = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel


class Planless(nn.Sequential):
    pass


class BadPlan(nn.Sequential):
    def tp_plan(self, tp_size):
        return {"0": "colwise"}


def planless(in_shape, num_classes):
    return Planless(nn.Flatten(), nn.Linear(64, num_classes))


def bad_plan(in_shape, num_classes):
    return BadPlan(nn.Flatten(), nn.Linear(64, num_classes))


def meta_fail(in_shape, num_classes):
    scale = torch.ones(1).item()  # reads a value: cannot be built on the meta device
    return nn.Sequential(nn.Flatten(), nn.Linear(64, int(scale) * 8), nn.Linear(8, num_classes))
"""


@pytest.mark.unit
@pytest.mark.parametrize(
    "function,message",
    [
        ("planless", "has no tensor-parallel plan: a model brings its own as a tp_plan(tp_size) method"),
        ("bad_plan", "tp_plan(2): tp_plan: '0': 'colwise' is not one of torch's parallel styles"),
    ],
)
def test_the_plan_refuses_a_model_of_ones_own_without_a_fitting_tp_plan(tmp_path, monkeypatch, function, message):
    from ddpkit.trainer import TrainConfig, resolve

    (tmp_path / "own_models.py").write_text(OWN_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(model=f"own_models:{function}", device="cpu", mesh="tp=2", nproc="2", out=str(tmp_path / "o"))
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve(cfg)


@pytest.mark.unit
def test_a_model_of_ones_own_that_cannot_be_built_on_meta_is_checked_for_pp_on_the_cpu(tmp_path, monkeypatch):
    from ddpkit.trainer import TrainConfig, resolve

    (tmp_path / "own_models.py").write_text(OWN_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(model="own_models:meta_fail", device="cpu", mesh="pp=2", nproc="2", out=str(tmp_path / "o"))
    assert resolve(cfg).cfg.model == "own_models:meta_fail"  # split into 2 stages, checked on the CPU
    with pytest.raises(UsageError, match="the model has 3 children to split into 4 stages"):
        resolve(TrainConfig(**{**cfg.__dict__, "mesh": "pp=4", "nproc": "4"}))


@pytest.mark.unit
def test_a_tp_plan_outside_tp_or_not_of_parallel_styles_is_refused():
    with pytest.raises(UsageError, match=r"tp_plan=...\) applies under tp only"):
        ddpkit.Runtime("ddp", device="cpu", tp_plan={"up": "colwise"})
    with pytest.raises(UsageError, match=r"tp_plan=...\) applies under tp only"):  # a pipeline without tp
        ddpkit.Runtime(device="cpu", mesh="pp=1", tp_plan={"up": "colwise"})
    with pytest.raises(UsageError, match="'up': 'colwise' is not one of torch's parallel styles"):
        ddpkit.Runtime("tp", device="cpu", tp_plan={"up": "colwise"})
    with pytest.raises(
        UsageError,
        match="Runtime\\(mesh=...\\) dp=2,tp=2: its sizes multiply to 4 processes, but the job has 1 \\(4 processes",
    ):
        ddpkit.Runtime(device="cpu", mesh={"dp": 2, "tp": 2})


@pytest.mark.cli
def test_a_one_process_checkpoint_is_refused_under_pp_with_tp_before_anything_starts(tmp_path):
    tiny = ("--model", "gpt", "--seq-len", "16", "--gpt-width", "16", "--gpt-depth", "2", "--batch-size", "8")
    out = str(tmp_path / "run")
    proc = run_cli("train", *tiny, "--device", "cpu", "--nproc", "1", "--max-steps", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr
    more = ("--device", "cpu", "--max-steps", "2", "--resume", "auto", "--out", out)
    proc = run_cli("train", *tiny, "--mesh", "pp=2,tp=2", "--nproc", "4", *more)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a one-process (or ddp) checkpoint, whose optimizer state does not load under" in proc.stderr
    assert not os.path.exists(os.path.join(out, "checkpoints", "step-00000002.pt"))


@pytest.mark.cli
def test_ddpkit_train_says_a_bad_mesh_in_one_line_and_exits_2(tmp_path):
    proc = run_cli("train", "--model", "gpt", "--mesh", "tp=2,dp=2", "--device", "cpu", "--out", str(tmp_path / "o"))
    fails_with_usage(proc, "--mesh dp=2,tp=2: its sizes multiply to 4 processes, but the job has 1 (--nproc 4")


@pytest.mark.distributed
def test_a_failure_names_the_rank_and_its_mesh_coordinates():
    with pytest.raises(
        ddpkit.WorkerFailed, match=r"^rank 1 \(tp=1, pid \d+\) on \S+ failed: ValueError: boom on tp=1$"
    ):
        ddpkit.launch(workers_mesh.fail_on_rank, 1, "tp=2", nproc=2, device="cpu")


# -- the promises on every layout ------------------------------------------------------------

LAYOUTS_4 = {
    "ddp": ("ddp", None),
    "fsdp": ("fsdp", None),
    "hsdp 2x2": ("hsdp", "replicate=2,dp=2"),
    "fsdp+tp 2x2": ("tp", "dp=2,tp=2"),
    "tp 4": ("tp", "tp=4"),
    "pp 4": ("pp", "pp=4"),  # a stage per child of the tiny gpt: embed, block0, block1, head
    "pp 2 x dp 2": ("pp", "pp=2,dp=2"),  # two pipelines, each stage under DDP over dp
    "pp 2 x tp 2": ("pp", "pp=2,tp=2"),  # each stage's layers split over tp
}
LAYOUTS_2 = {
    "tp 2": ("tp", "tp=2"),
    "hsdp 2x1": ("hsdp", "replicate=2,dp=1"),
    "pp 2": ("pp", "pp=2"),
    "pp 2 gpipe": ("pp", "pp=2"),
}
LAYOUTS_8 = {
    # 3-D: two pipelines (dp) of two stages (pp), each stage's layers split over tp and sharded over dp
    "pp 2 x dp 2 x tp 2": ("pp", "pp=2,dp=2,tp=2"),
}
SCHEDULES = {"pp 2 gpipe": "gpipe"}  # the others: 1f1b


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    """One process; every 4-process layout and the chain's first two legs in one job (with side
    legs onto pp x dp and pp x tp); the 3-D layout and a side leg onto it in an 8-process job; the
    chain's third leg in a 2-process job; its fourth here; the 2-process layouts and its last leg
    in another 2-process job."""
    folder = tmp_path_factory.mktemp("chain")
    ck = {leg: str(folder / leg) for leg in ("a", "b", "c", "d", "pp", "grouped one", "grouped pp")}
    one = workers_mesh.train(("ddp", None))
    unclipped = workers_mesh.train(("ddp", None), max_grad_norm=None)
    llama = workers_mesh.train(("ddp", None), shape=workers_mesh.LLAMA)
    four = {name: {"layout": layout} for name, layout in LAYOUTS_4.items()}
    # The resume chain: fsdp+tp 2x2 to step 1 -> hsdp 2x2 to 3 -> tp 2 to 4 -> one process to 5 -> pp 2 to 6.
    four["chain a"] = {"layout": LAYOUTS_4["fsdp+tp 2x2"], "save_at": 1, "save": ck["a"], "steps": 1}
    four["chain b"] = {
        "layout": LAYOUTS_4["hsdp 2x2"],
        "load": ck["a"],
        "start": 1,
        "save_at": 3,
        "save": ck["b"],
        "steps": 3,
    }
    # A side leg: the chain's first checkpoint resumed by two pipelines (pp 2 x dp 2), to the end.
    four["chain pp x dp"] = {"layout": LAYOUTS_4["pp 2 x dp 2"], "load": ck["a"], "start": 1, "schedule": "gpipe"}
    four["chain pp x tp"] = {"layout": LAYOUTS_4["pp 2 x tp 2"], "load": ck["a"], "start": 1}
    four["checkpointed"] = {"layout": LAYOUTS_4["fsdp+tp 2x2"], "checkpointing": True}
    four["llama"] = {"layout": LAYOUTS_4["fsdp+tp 2x2"], "shape": workers_mesh.LLAMA}
    four["llama selective"] = {**four["llama"], "checkpointing": "selective"}
    # each stage's DDP with a compression hook, which all-reduces over dp (not every rank)
    four["pp x dp fp16 hook"] = {"layout": LAYOUTS_4["pp 2 x dp 2"], "ddp": {"comm_hook": "fp16"}}
    four["user plan pp"] = {"user_plan_pp": "pp=2,tp=2"}  # a plan for the first stage's layers only
    four["same layout"] = {"layout": LAYOUTS_4["fsdp+tp 2x2"], "load": ck["a"], "start": 1}
    out4 = ddpkit.launch(workers_mesh.layouts, four, nproc=4, device="cpu")
    eight = {name: {"layout": layout} for name, layout in LAYOUTS_8.items()}
    eight["chain 3-D"] = {"layout": LAYOUTS_8["pp 2 x dp 2 x tp 2"], "load": ck["a"], "start": 1}
    out8 = ddpkit.launch(workers_mesh.layouts, eight, nproc=8, device="cpu")
    leg_c = {"layout": LAYOUTS_2["tp 2"], "load": ck["b"], "start": 3, "save_at": 4, "save": ck["c"], "steps": 4}
    ddpkit.launch(workers_mesh.layouts, {"chain c": leg_c}, nproc=2, device="cpu")
    workers_mesh.train(("ddp", None), load=ck["c"], start=4, save_at=5, save=ck["d"], steps=5)
    two = {name: {"layout": layout, "schedule": SCHEDULES.get(name, "1f1b")} for name, layout in LAYOUTS_2.items()}
    two["user plan"] = {"user_plan": "tp=2"}
    two["old qkv"] = {"old_qkv": "tp=2"}
    two["chain e"] = {"layout": LAYOUTS_2["pp 2"], "load": ck["d"], "start": 5}
    two["pp saved"] = {"layout": LAYOUTS_2["pp 2"], "save_at": 3, "save": ck["pp"], "steps": 3}
    two["pp resumed"] = {"layout": LAYOUTS_2["pp 2"], "load": ck["pp"], "start": 3}
    two["pp checkpointed"] = {"layout": LAYOUTS_2["pp 2"], "checkpointing": True}
    two["pp selective"] = {"layout": LAYOUTS_2["pp 2"], "checkpointing": "selective"}
    two["pp counted"] = {"counted": "pp=2"}
    two["tp bf16"] = {"dtype": "tp=2"}
    # Optimizers with no parameter (or a group with none) on a stage: saved, resumed under pp
    # and on one process; and one process's single file resumed under pp.
    workers_mesh.grouped(None, save_at=2, save=ck["grouped one"])
    two["grouped"] = {"grouped": {"mesh": "pp=2", "save_at": 2, "save": ck["grouped pp"]}}
    two["grouped pp-pp"] = {"grouped": {"mesh": "pp=2", "load": ck["grouped pp"], "start": 2}}
    two["grouped one-pp"] = {"grouped": {"mesh": "pp=2", "load": ck["grouped one"], "start": 2}}
    out2 = ddpkit.launch(workers_mesh.layouts, two, nproc=2, device="cpu")
    user = workers_mesh.user_plan(None)
    user_pp = workers_mesh.user_plan_pp(None)
    counted = workers_mesh.counted_forwards(None)
    grouped = workers_mesh.grouped(None)
    grouped_resumed = workers_mesh.grouped(None, load=ck["grouped pp"], start=2)
    return {
        "one": one,
        "unclipped": unclipped,
        "llama": llama,
        "four": out4,
        "eight": out8,
        "two": out2,
        "user plan": user,
        "user plan pp": user_pp,
        "counted": counted,
        "grouped": grouped,
        "grouped pp-one": grouped_resumed,
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYOUTS_8, *LAYOUTS_4, *LAYOUTS_2])
def test_every_layout_trains_evaluates_and_saves_as_one_process(mesh_runs, name):
    """Token weighting with dropout, micro-batches (empty ones on some ranks), clipping by the
    global norm over every shard and tp slice: the weights equal one process's within
    rounding; the evaluation counts each test sample once and gathers its predictions in order;
    the global batch is read once per data rank; the state is one plain state_dict."""
    one = mesh_runs["one"]
    assert (mesh_runs["unclipped"]["weights"] - one["weights"]).abs().max() > 1e-3  # the clipping clipped
    nproc = 8 if name in LAYOUTS_8 else 4 if name in LAYOUTS_4 else 2
    out = mesh_runs[{8: "eight", 4: "four", 2: "two"}[nproc]]
    asked, mesh = (LAYOUTS_8 | LAYOUTS_4 | LAYOUTS_2)[name]
    spec = MeshSpec.parse(mesh or f"dp={nproc}")
    for rank in range(nproc):
        r = out[rank][name]
        assert r["strategy"] == asked and r["mesh"] == str(spec)
        assert r["data_world_size"] == spec.data_size and r["data_rank"] == spec.data_rank(rank)
        assert r["where"] == ("" if mesh is None else ",".join(f"{k}={v}" for k, v in spec.coordinates(rank).items()))
        assert r["samples"] == one["samples"] == len(workers_mesh.uneven_text())  # each test sample once
        assert r["trained_samples"] == one["trained_samples"]  # the tp ranks' shared samples count once
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
        assert torch.equal(r["predictions"], one["predictions"])  # every sample, in dataset order
    rank0 = out[0][name]
    assert rank0["names"] == one["names"]  # bare names: no module., no _orig_mod.
    torch.testing.assert_close(rank0["weights"], one["weights"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_precision_and_ddp_options_hold_on_a_mesh(mesh_runs):
    """bf16 under tp on one data rank (nothing sharded, so no FSDP policy) computes in bf16, by
    autocast; each pipeline stage's DDP takes a compression hook over its dp group, and ends
    within fp16's rounding of one process."""
    assert mesh_runs["two"][0]["tp bf16"] == "torch.bfloat16"
    hooked = mesh_runs["four"][0]["pp x dp fp16 hook"]
    assert hooked["steps"] == workers_mesh.STEPS
    torch.testing.assert_close(hooked["weights"], mesh_runs["one"]["weights"], rtol=0, atol=1e-3)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_resumes_across_layouts_and_bit_identical_on_the_same(mesh_runs):
    """fsdp+tp 2x2 -> hsdp 2x2 -> tp 2 -> one process -> pp 2, each leg resuming the last one's
    checkpoint (sharded, but the one-process leg's single file): the end equals the straight run
    within rounding, and so do side legs resuming the first checkpoint on pp 2 x dp 2 (gpipe),
    on pp 2 x tp 2, and on the 3-D pp 2 x dp 2 x tp 2.
    Resumed on its own layout, a run ends bit-identical to the straight run there (fsdp+tp 2x2
    and pp 2)."""
    four, two, one = mesh_runs["four"], mesh_runs["two"], mesh_runs["one"]
    assert four[0]["chain b"]["steps"] == 3 and two[0]["chain e"]["steps"] == workers_mesh.STEPS
    torch.testing.assert_close(two[0]["chain e"]["weights"], one["weights"], rtol=0, atol=WORLD_SIZE_ATOL)
    side = {leg: four[0][leg] for leg in ("chain pp x dp", "chain pp x tp")} | {
        "3-D": mesh_runs["eight"][0]["chain 3-D"]
    }
    for leg in side.values():
        assert leg["steps"] == workers_mesh.STEPS
        torch.testing.assert_close(leg["weights"], one["weights"], rtol=0, atol=WORLD_SIZE_ATOL)
    assert torch.equal(four[0]["same layout"]["weights"], four[0]["fsdp+tp 2x2"]["weights"])
    assert torch.equal(two[0]["pp resumed"]["weights"], two[0]["pp 2"]["weights"])


@pytest.mark.distributed
@pytest.mark.slow
def test_a_model_of_ones_own_trains_under_tp_with_the_plan_given_to_the_runtime(mesh_runs):
    """docs/parallelism.md's example: a plan of torch's styles for a model with no plan of its
    own, given to Runtime(tp_plan=...), on tp=2 ends where one process ends; on samples with
    noise drawn from the process's stream as they are read, which the two ranks of the tp group
    (one data rank) draw alike, as the one process does."""
    tp = mesh_runs["two"][0]["user plan"]
    torch.testing.assert_close(tp, mesh_runs["user plan"], rtol=0, atol=WORLD_SIZE_ATOL)
    # Under pp x tp, a stage none of whose layers the plan names runs whole on its tp ranks.
    pp_tp = mesh_runs["four"][0]["user plan pp"]
    torch.testing.assert_close(pp_tp, mesh_runs["user plan pp"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_llama_shaped_gpt_under_fsdp_and_tp_trains_as_one_process(mesh_runs):
    """gpt with style llama (grouped-query attention over two key/value heads, SwiGLU, rotary
    positions, RMSNorm): tp's plan splits its gate, up and down maps and its key/value heads, and
    2x2 computes what one process does, within rounding."""
    one, one_gpt2 = mesh_runs["llama"], mesh_runs["one"]
    assert len(one["weights"]) != len(one_gpt2["weights"])  # another model, not the default shape
    assert "block0.mlp.gate.weight" in one["names"] and "embed.positions.weight" not in one["names"]
    for rank in range(4):
        r = mesh_runs["four"][rank]["llama"]
        assert r["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=0)
        assert torch.equal(r["predictions"], one["predictions"])
    rank0 = mesh_runs["four"][0]["llama"]
    assert rank0["names"] == one["names"]
    torch.testing.assert_close(rank0["weights"], one["weights"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.distributed
@pytest.mark.slow
def test_activation_checkpointing_under_fsdp_and_tp_or_pp_changes_no_bit(mesh_runs):
    """Each block's activations checkpointed under fsdp+tp 2x2 (its forward run again in the
    backward, dropout masks drawn again alike), in full or selectively: the same weights to the
    last bit."""
    four = mesh_runs["four"][0]
    assert four["checkpointed"]["checkpointed"] == ["block0", "block1", "embed", "head"]
    assert four["fsdp+tp 2x2"]["checkpointed"] == []
    assert torch.equal(four["checkpointed"]["weights"], four["fsdp+tp 2x2"]["weights"])
    two = mesh_runs["two"]  # and under pp 2 (each stage's blocks, run again in the backward of each micro-batch)
    assert two[0]["pp checkpointed"]["checkpointed"] == ["block0", "embed"]
    assert two[1]["pp checkpointed"]["checkpointed"] == ["block1", "head"]
    assert torch.equal(two[0]["pp checkpointed"]["weights"], two[0]["pp 2"]["weights"])
    # selective: attention's and every other product's outputs kept, the rest recomputed; the
    # llama-shaped gpt under fsdp+tp, and pp
    assert four["llama selective"]["checkpointed"] == ["block0", "block1", "embed", "head"]
    assert torch.equal(four["llama selective"]["weights"], four["llama"]["weights"])
    assert two[1]["pp selective"]["checkpointed"] == ["block1", "head"]
    assert torch.equal(two[0]["pp selective"]["weights"], two[0]["pp 2"]["weights"])


@pytest.mark.distributed
@pytest.mark.slow
def test_an_older_gpt_state_with_fused_qkv_loads_into_a_split_model(mesh_runs):
    """ddpkit 0.2's gpt state (one fused qkv map per block) loaded whole into gpt split by tp over
    2 ranks: its q, k and v parts land on their ranks' slices, as in the bare model."""
    got = mesh_runs["two"][0]["old qkv"]
    assert torch.equal(got["split"], got["bare"])


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_stage_runs_each_micro_batch_once_and_nothing_else(mesh_runs):
    """A module that counts its training forwards in a buffer (as running statistics do) counts
    the same under pp=2 as on one process: torch's look at the shapes before the first step,
    which runs the stage on uninitialized tensors, leaves no trace."""
    assert mesh_runs["counted"] == 4  # two steps of two micro-batches
    assert mesh_runs["two"][0]["pp counted"] == mesh_runs["counted"]


@pytest.mark.distributed
@pytest.mark.slow
def test_optimizers_a_stage_holds_no_parameter_of_save_and_resume_across_pp(mesh_runs):
    """Two optimizers over three parameter groups of their own settings, a LambdaLR and an EMA,
    under pp=2, where a stage holds none of some groups' parameters (and of one optimizer's):
    saved and resumed under pp it ends bit-identical; resumed on one process, and one process's
    single file resumed under pp, they end as the straight run within rounding, the schedule's
    learning rates in place."""
    straight, two = mesh_runs["grouped"], mesh_runs["two"][0]
    assert torch.equal(two["grouped pp-pp"]["weights"], two["grouped"]["weights"])
    for resumed in (mesh_runs["grouped pp-one"], two["grouped one-pp"], two["grouped"]):
        torch.testing.assert_close(resumed["weights"], straight["weights"], rtol=0, atol=WORLD_SIZE_ATOL)
        assert resumed["lr"] == straight["lr"]
