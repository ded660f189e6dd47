"""`ddpkit plan`: fake traces of ddpkit's own layouts, the prediction's arithmetic, the
recommendation, and the command line (against real runs: test_real_runs.py)."""

import json
import os
import time
from dataclasses import replace

import pytest
import torch

from ddpkit.launcher.workers import choose_start_method
from ddpkit.observe.collectives import Op
from ddpkit.plan import Spec, cluster, output, plan
from ddpkit.plan.predict import best, op_seconds, predict
from ddpkit.plan.run import _micro_batches, _parts, command
from ddpkit.plan.trace import Layout, Step, Trace, flops, in_fake_worlds, trace

GPT = {"width": 64, "depth": 2, "heads": 4}


def _spec(batch=8, **kw):
    return Spec("gpt", (32,), 256, batch, "fp32", "adamw", dict(GPT), **kw)


@pytest.mark.unit
def test_ring_model_of_one_collective_within_and_across_nodes():
    c = cluster("h100", 8, 2, intra_gbps=100, inter_gbps=10)
    inside = Op("all_reduce", 10**9, tuple(range(8)))
    across = Op("all_reduce", 10**9, tuple(range(0, 16, 2)))
    # 2(n-1) latencies and 2(n-1)/n of the payload on the wire
    assert op_seconds(inside, c) == pytest.approx(14 * 5e-6 + 1.75 * 10**9 / 100e9)
    assert op_seconds(across, c) == pytest.approx(14 * 10e-6 + 1.75 * 10**9 / 10e9)
    assert op_seconds(Op("all_gather", 10, (3,)), c) == 0.0


@pytest.mark.unit
def test_flops_per_sample_are_forward_and_backward_and_what_checkpointing_recomputes():
    # mlp on 64 inputs: Linear 64->30, 30->20, 20->10. A product of in x out costs 2 in out
    # FLOPs forward, and as much for each gradient it computes backward: the weight's always,
    # the input's except for the first layer (the data needs none).
    spec = Spec("mlp", (64,), 10, 8, "fp32", "adamw")
    sizes = [(64, 30), (30, 20), (20, 10)]
    forward = sum(2 * i * o for i, o in sizes)
    backward = 2 * forward - 2 * 64 * 30
    assert flops(spec.build, spec.batch, False) == forward + backward
    # checkpointing recomputes what a block saved beyond its inputs: a lone Linear saves only
    # its input and weight, so nothing; a gpt block, its attention and MLP (at most a forward)
    assert flops(spec.build, spec.batch, True) == forward + backward
    gpt = _spec()
    plain, checkpointed = flops(gpt.build, gpt.batch, False), flops(gpt.build, gpt.batch, True)
    assert plain < checkpointed <= plain * 4 / 3


@pytest.mark.unit
def test_train_command_reproduces_the_planned_job():
    c = cluster("h100", 4, 2)
    gpt = command(_spec(), c, Layout("tp", "dp=4,tp=2", True, 1))
    assert "--data text --seq-len 32 --gpt-width 64 --gpt-depth 2 --gpt-heads 4" in gpt
    assert "--nproc 4 --nnodes 2" in gpt and "--mesh dp=4,tp=2" in gpt and "--micro-batch-size 1" in gpt
    assert "--activation-checkpointing true" in gpt
    mnist = Spec("cnn", (1, 28, 28), 10, 8, "fp32", "sgd", data="mnist")
    assert "--model cnn --data mnist " in command(mnist, c, Layout("ddp", "dp=8", False, 1))
    own = Spec("cnn", (3, 16, 16), 7, 8, "fp32", "sgd", data="synthetic")
    assert "--data synthetic --synthetic-shape 3,16,16 --num-classes 7" in command(
        own, c, Layout("ddp", "dp=8", False, 1)
    )


@pytest.mark.unit
def test_a_pipelines_step_is_a_stages_compute_with_its_bubble_and_its_sends():
    # pp=4 over 8 micro-batches of 2: each stage idles for 3 micro-batches' time of the 8's, and
    # its sends (a micro-batch's activations forward, their gradients back) cost in full
    c = cluster("h100", 4, 1, efficiency=0.5)
    sends = [Op("send", 10**6, (0, 1, 2, 3), 16)]
    layout = Layout("pp", "pp=4", False, 2)
    q = predict(Trace({"activations": 1.0}, 1.0, sends, 4e12), layout, c, 1e14, 16, 32, 1.0)
    compute = 4e12 / (1e14 * 0.5) * (8 + 3) / 8
    assert q.compute_s == pytest.approx(compute)
    assert q.exposed_comm_s == pytest.approx(16 * op_seconds(sends[0], c)) and q.overlapped_comm_s == 0
    assert q.step_s == pytest.approx(compute + q.exposed_comm_s)
    assert "--strategy pp --mesh pp=4" in command(_spec(16), c, layout)
    assert layout.label == "pp 4 mb2"


@pytest.mark.unit
def test_pipelines_beside_each_other_reduce_each_stages_gradients_beside_its_last_backward():
    # pp=2,dp=2 over 4 micro-batches of 2 per pipeline: the bubble of one micro-batch, the sends
    # in full, and the stage's DDP all-reduce beside its last micro-batch's backward (2/3 of a
    # micro-batch's compute), what exceeds that exposed
    c = cluster("h100", 4, 1, efficiency=0.5)
    layout = Layout("pp", "pp=2,dp=2", False, 2)
    sends, reduce = Op("send", 10**6, (0, 2), 8), Op("all_reduce", 10**10, (0, 1))
    q = predict(Trace({"activations": 1.0}, 1.0, [sends, reduce], 4e12), layout, c, 1e14, 16, 32, 1.0)
    busy = 4e12 / (1e14 * 0.5)
    window = busy / 4 * 2 / 3
    assert op_seconds(reduce, c) > window  # (the check below sees the max's both sides)
    assert q.compute_s == pytest.approx(busy * (4 + 1) / 4)
    assert q.overlapped_comm_s == pytest.approx(op_seconds(reduce, c))
    assert q.exposed_comm_s == pytest.approx(8 * op_seconds(sends, c) + op_seconds(reduce, c) - window)
    hidden = predict(Trace({}, 1.0, [sends, replace(reduce, bytes=10**6)], 4e12), layout, c, 1e14, 16, 32, 1.0)
    assert hidden.exposed_comm_s == pytest.approx(8 * op_seconds(sends, c))  # all within the window
    assert layout.label == "pp 2 x dp 2 mb2"
    assert "--strategy pp --mesh pp=2,dp=2 --batch-size 16" in command(_spec(16), c, layout)


@pytest.mark.unit
def test_each_pipeline_stage_is_timed_on_its_own_and_the_slowest_sets_the_step():
    # stage 0 computes most, stage 1 sends most: the step is the slower of the two stages'
    # own times, not the most compute plus the most sends (another stage's)
    c = cluster("h100", 2, 1, efficiency=0.5)
    layout = Layout("pp", "pp=2", False, 2)
    heavy, light = Op("send", 10**6, (0, 1), 8), Op("send", 10**9, (0, 1), 8)
    first, second = Trace({}, 1.0, [heavy], 4e12), Trace({}, 2.0, [light], 1e12)
    both = Trace({"activations": 2.0}, 2.0, second.ops, 0.0, stages=[first, second])
    q = predict(both, layout, c, 1e14, 16, 32, 1.0)
    bubble = (8 + 1) / 8
    times = [t.flops / (1e14 * 0.5) * bubble + 8 * op_seconds(t.ops[0], c) for t in (first, second)]
    assert times[0] != pytest.approx(times[1])  # (one stage is the slower)
    assert q.step_s == pytest.approx(max(times))
    assert q.step_s < 4e12 / (1e14 * 0.5) * bubble + 8 * op_seconds(light, c)  # the old upper bound
    slowest = (first, second)[times.index(max(times))]
    assert (q.trace.flops, q.trace.ops, q.trace.peak) == (slowest.flops, slowest.ops, 2.0)
    # predicted again from its own trace (on another cluster), it still times each stage
    again = predict(q.trace, layout, c, 1e14, 16, 32, 1.0)
    assert again.step_s == pytest.approx(q.step_s)


@pytest.mark.unit
def test_a_pipelines_time_is_its_slowest_stages_counted_flops_as_the_split_cuts_it():
    from ddpkit.plan.run import stage_flops
    from ddpkit.plan.trace import child_flops

    # the split balances parameters, not FLOPs: a large embedding shares its stage with a block
    sizes = {"embed": 100, "block0": 50, "block1": 50, "head": 100}
    counted = {False: {"embed": 0.0, "block0": 10.0, "block1": 10.0, "head": 30.0}}
    assert stage_flops((sizes, counted), False, 2) == [10.0, 40.0]
    assert stage_flops((sizes, counted), False, 4) == [0.0, 10.0, 10.0, 30.0]
    # gpt's children: the embedding counts no products, each block the same, the head its
    # logits' (and what checkpointing recomputes is its block's)
    spec = _spec()
    plain, full = (child_flops(spec.build, spec.batch, ac) for ac in (False, True))
    assert list(plain) == ["embed", "block0", "block1", "head"] and plain["embed"] == 0
    assert plain["block0"] == plain["block1"] and sum(plain.values()) == flops(spec.build, spec.batch, False)
    assert full["block0"] > plain["block0"] and full["head"] == plain["head"]


@pytest.mark.unit
def test_a_pipeline_tries_4_micro_batches_per_stage_first_then_fewer_rows():
    from ddpkit.plan.run import _pipeline_micro_batches

    assert _pipeline_micro_batches(64, 4) == [4, 2, 1]  # 16 micro-batches of 4 first
    assert _pipeline_micro_batches(24, 2) == [2, 1]  # 12 of 2 (3 rows, 8 of them, is not a size tried)
    assert _pipeline_micro_batches(8, 4) == [1]  # 8 rows: the most micro-batches there can be
    assert _pipeline_micro_batches(4, 4) == [1]  # and never fewer than a stage each
    # gpipe, where the rows are fewer than the stages: a row each, the most micro-batches
    assert _pipeline_micro_batches(6, 8, "gpipe") == [1] and _pipeline_micro_batches(1, 2, "gpipe") == [1]
    fewer = Layout("pp", "pp=4,dp=2", False, 1, "gpipe")
    assert fewer.label == "pp 4 x dp 2 gpipe mb1"
    said = command(_spec(4), cluster("h100", 8, 1), fewer)
    assert "--mesh pp=4,dp=2 --batch-size 4 " in said and said.endswith("--micro-batch-size 1 --pp-schedule gpipe")


@pytest.mark.unit
def test_pipelines_are_planned_for_a_gpt_of_enough_blocks_and_not_for_other_models():
    from ddpkit.plan.predict import layouts
    from ddpkit.plan.run import _stages

    c4 = cluster("h100", 4, 1)
    assert _stages(_spec()) == 4  # embedding, 2 blocks, head

    def pipelines(planned):  # {mesh: schedule}
        return {q.mesh: q.schedule for q in planned if q.strategy == "pp"}

    # 1f1b where each stage has a micro-batch at least, gpipe where the rows are fewer than stages
    assert pipelines(layouts(c4, _spec(4).share, 4, (False,), 4)) == {
        "pp=2,dp=2": "1f1b",
        "pp=4": "1f1b",
        "pp=2,tp=2": "1f1b",
    }
    # a child short of 4 stages: two pipelines of 2, or one beside tp
    assert pipelines(layouts(c4, _spec(4).share, 4, (False,), 3)) == {"pp=2,dp=2": "1f1b", "pp=2,tp=2": "1f1b"}
    # 2 samples: a row to each of two pipelines of 2, 2 rows to 4 stages: gpipe; 2 to 2 stages beside tp
    assert pipelines(layouts(c4, _spec(2).share, 4, (False,), 4)) == {
        "pp=2,dp=2": "gpipe",
        "pp=4": "gpipe",
        "pp=2,tp=2": "1f1b",
    }

    # on 8 GPUs: pipelines of 2, 4 and 8 stages, one per data rank, and pipelines whose stages
    # split their layers over tp within the node, one (pp x tp) or two (3-D: each stage sharded
    # over its 2 data ranks), as far as the 4 heads divide
    def on_8(batch, stages):
        return pipelines(layouts(cluster("h100", 8, 1), _spec(batch).share, 4, (False,), stages))

    tp = {"pp=2,tp=4", "pp=4,tp=2", "pp=2,dp=2,tp=2"}
    every = {"pp=2,dp=4", "pp=4,dp=2", "pp=8", *tp}
    assert on_8(16, 8) == dict.fromkeys(every, "1f1b")
    assert on_8(16, 4) == dict.fromkeys(every - {"pp=8"}, "1f1b")  # 4 children: no stage for 4 more GPUs
    assert on_8(8, 8) == dict.fromkeys(every, "1f1b")  # 2, 4 and 8 rows to the pipelines
    # 1 row to each of 4 pipelines of 2, 2 to each of 2 of 4, 4 to 8 stages: gpipe
    assert on_8(4, 8) == {**dict.fromkeys(tp, "1f1b"), **dict.fromkeys(every - tp, "gpipe")}
    two_heads = layouts(cluster("h100", 8, 1), _spec(16).share, 2, (False,), 8)
    assert {q.mesh for q in two_heads if "tp" in q.mesh and q.strategy == "pp"} == {"pp=4,tp=2", "pp=2,dp=2,tp=2"}
    # on 2 nodes of 4: tp within a node
    assert {q.mesh for q in layouts(cluster("h100", 4, 2), _spec(16).share, 4, (False,), 8) if "tp" in q.mesh} == {
        "dp=4,tp=2",
        "dp=2,tp=4",
        "pp=4,tp=2",
        "pp=2,tp=4",
        "pp=2,dp=2,tp=2",
    }
    assert _stages(Spec("cnn", (3, 16, 16), 10, 8, "bf16", "adamw")) == 0  # BatchNorm: no pipeline
    assert _stages(replace(_spec(), precision="fp16")) == 0  # a pipeline does not run fp16
    deep = replace(_spec(), options={**GPT, "depth": 100})
    assert (
        _stages(deep) == 0 and _stages(replace(deep, strategies=("pp",))) == 102
    )  # a deep gpt's: asked for; a child a stage at most


@pytest.mark.unit
def test_on_a_tie_the_layout_without_checkpointing_is_recommended():
    from ddpkit.plan.predict import Prediction

    def row(ac, peak):
        trace = Trace(dict.fromkeys(("activations",), 0.0), peak, [], 0.0)
        return Prediction(Layout("ddp", "dp=4", ac, 1), trace, 1.0, 0.0, 0.0, 1.0, 1.0, None, 0.5, True)

    assert best([row(True, 1.0), row(False, 2.0)]).layout.checkpointing is False


@pytest.mark.unit
def test_micro_batches_are_the_share_then_powers_of_two_dividing_it():
    assert _micro_batches(12) == [12, 4, 2, 1]
    assert _micro_batches(1) == [1]


@pytest.mark.unit
def test_a_meshs_layouts_are_traced_in_one_process_the_costliest_first_where_the_cores_stay_busy():
    todo = [
        Layout(s, m, ac, 0) for s, m in (("ddp", "dp=8"), ("fsdp", "dp=8"), ("tp", "dp=4,tp=2")) for ac in (False, True)
    ]
    ddp, ddp_ac, fsdp, fsdp_ac, tp, tp_ac = todo
    # two cores: fsdp's and tp's layouts share a process each (DTensor's sharding, worked out
    # once); ddp's share nothing and go alone, last
    assert _parts(todo, 2) == [[tp, tp_ac], [fsdp, fsdp_ac], [ddp], [ddp_ac]]
    # more cores than those parts: one layout to a process
    assert _parts(todo, 8) == [[tp], [tp_ac], [fsdp], [fsdp_ac], [ddp], [ddp_ac]]


def _trace(layout, world):
    spec = _spec()
    return trace(Step(spec.build, spec.batch, 4, "fp32", "adamw"), layout, world)


@pytest.mark.distributed  # a fake world of 4 ranks, in a process of its own
def test_fsdp_trace_shards_states_and_counts_its_collectives():
    # the traces run in a process of their own, as the plan's do: a fake world left behind in
    # this one would change how the suite's later jobs start (see trace.in_fake_worlds)
    fsdp, ddp = in_fake_worlds(
        4, [(_trace, (Layout("fsdp", "dp=4", False, 2), 4)), (_trace, (Layout("ddp", "dp=4", False, 4), 4))]
    )
    params = sum(p.numel() for p in _spec().build().parameters()) * 4
    # AdamW's two moments, on a quarter of the parameters each under fsdp (padding aside)
    assert fsdp.memory["optimizer"] == pytest.approx(2 * params / 4, rel=0.02)
    assert ddp.memory["optimizer"] == pytest.approx(2 * params, rel=0.01)
    assert ddp.memory["communication"] == params  # DDP's buckets: one more copy of the gradients
    kinds = {op.kind for op in fsdp.ops}
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert all(op.ranks == (0, 1, 2, 3) for op in fsdp.ops)


def _stage(layout, index, batch):
    from ddpkit.plan.pipeline import trace_stage

    spec = _spec(batch)
    step = Step(spec.build, spec.batch, spec.share(layout.spec.data_size), "fp32", "adamw")
    return trace_stage(step, layout, layout.spec.processes, index)


def _by_torchs_tracker_and_the_plans(layout, index):
    from unittest import mock

    from ddpkit.plan import trace as tracing

    def traced():
        return _trace(layout, layout.spec.processes) if index is None else _stage(layout, index, 8)

    with mock.patch.object(tracing, "_peak_only", lambda tracker: tracker):  # torch's own, as it is
        torchs = traced()
    return torchs, traced()


@pytest.mark.distributed  # a fake world of 2 ranks, in a process of its own
def test_the_plans_memory_trackers_keep_torchs_peak_and_its_roles_to_the_byte():
    # the plan's trackers keep the step's peak alone, not every module's as torch's do (the
    # costliest part of a trace): the same peak, role by role, under each of torch's trackers
    pp = Layout("pp", "pp=2", False, 2)
    cases = [
        (Layout("ddp", "dp=2", False, 2), None),  # MemTracker
        (Layout("fsdp", "dp=2", True, 2), None),  # FSDPMemTracker, with checkpointing
        (Layout("tp", "tp=2", False, 4), None),  # MemTracker over DTensors
        (pp, 0),  # a pipeline's stages: MemTracker for a module called once per micro-batch
        (pp, 1),
    ]
    for (layout, index), (torchs, ours) in zip(
        cases, in_fake_worlds(2, [(_by_torchs_tracker_and_the_plans, c) for c in cases])
    ):
        assert torchs.peak > 0, layout.label
        assert ours.memory == torchs.memory, (layout.label, index)


@pytest.mark.distributed  # fake worlds of 2, 4 and 8 ranks, in processes of their own
def test_pipelines_beside_dp_or_tp_hold_what_one_pipeline_alone_does_and_their_own_share():
    # pp=2,dp=2: data rank 0's pipeline (ranks 0 and 2) on its half of the batch, each stage's
    # gradients all-reduced over its own two ranks; pp=2,tp=2: one pipeline (ranks 0 and 2, tp
    # rank 0 of each stage) on the whole batch, each stage's layers split over its tp ranks (0
    # and 1 for the traced one); beside them one pipeline of the same 4 rows alone
    layout, split, alone = (Layout("pp", mesh, False, 2) for mesh in ("pp=2,dp=2", "pp=2,tp=2", "pp=2"))
    calls = [(_stage, (layout, s, 8)) for s in (0, 1)] + [(_stage, (split, s, 4)) for s in (0, 1)]
    first, last, *tp_stages = in_fake_worlds(4, calls)
    pipeline = in_fake_worlds(2, [(_stage, (alone, s, 4)) for s in (0, 1)])
    for index, (traced, one) in enumerate(zip((first, last), pipeline)):
        reduces = [op for op in traced.ops if op.kind == "all_reduce"]
        assert [op.ranks for op in reduces] == [((0, 1), (2, 3))[index]]
        assert reduces[0].bytes == traced.memory["parameters"]  # fp32: the stage's gradients, as its parameters
        assert traced.memory["communication"] == one.memory["communication"] + reduces[0].bytes  # DDP's buckets
        for role in ("parameters", "gradients", "optimizer", "activations"):  # the rest as one pipeline's
            assert traced.memory[role] == one.memory[role], role
        assert {op.ranks for op in traced.ops if op.kind == "send"} == {(0, 2)}  # the pipeline's own group
        assert [op.bytes for op in traced.ops if op.kind == "send"] == [op.bytes for op in one.ops if op.kind == "send"]
    for traced, one in zip(tp_stages, pipeline):
        # the layers' weights halved, the norms and positions whole: a little over half
        assert 0.5 < traced.memory["parameters"] / one.memory["parameters"] < 0.6, (traced.memory, one.memory)
        assert traced.memory["optimizer"] < 0.6 * one.memory["optimizer"]
        sends = [op for op in traced.ops if op.kind == "send"]
        assert {op.ranks for op in sends} == {(0, 2)}  # the pipeline's own group
        assert [op.bytes for op in sends] == [op.bytes for op in one.ops if op.kind == "send"]  # whole activations
        within = [op for op in traced.ops if op.kind != "send"]
        assert within and {op.ranks for op in within} == {(0, 1)}  # tp's, over the stage's tp ranks
        assert "pp x tp: the stage's layers split over tp=2 by the model's tensor-parallel plan" in traced.computed
    # 3-D, pp=2,dp=2,tp=2: two such pipelines (ranks 0, 1 | 4, 5 and 2, 3 | 6, 7), each stage's
    # shards over its 2 data ranks (FSDP2's collectives over ranks 0 and 2): half the optimizer's
    # state; the parameters' shards, and at the peak units of them gathered whole beside them
    # (stage 0: all of them; the real run's are the same, tests/plan/test_real_runs.py)
    cube = Layout("pp", "pp=2,dp=2,tp=2", False, 2)
    for traced, split in zip(in_fake_worlds(8, [(_stage, (cube, s, 8)) for s in (0, 1)]), tp_stages):
        assert traced.memory["optimizer"] == pytest.approx(split.memory["optimizer"] / 2, rel=0.02)
        assert split.memory["parameters"] / 2 < traced.memory["parameters"] <= 1.5 * split.memory["parameters"]
        kinds = {(op.kind, op.ranks) for op in traced.ops}
        assert {("all_gather", (0, 2)), ("reduce_scatter", (0, 2)), ("send", (0, 4))} <= kinds
        assert {ranks for kind, ranks in kinds if kind == "all_reduce"} == {(0, 1)}  # tp's alone: no DDP


def _collections_here():
    import gc

    return gc.isenabled(), gc.get_freeze_count()


@pytest.mark.distributed  # a fake world of 2 ranks, in processes of their own
def test_a_forked_trace_process_collects_only_what_it_makes():
    # The objects a trace process forked from this one inherited are frozen before anything else
    # runs there: its garbage collections never walk them (one crashed in DTensor's code, forked
    # from a pytest process with a long history). Spawned, it inherits nothing to freeze.
    import gc

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    results = in_fake_worlds(2, [(_collections_here, ()), (_collections_here, ())])
    assert gc.isenabled() and gc.get_freeze_count() == frozen  # this process's collections as they were
    if choose_start_method("cpu") == "fork":
        assert all(on and count > frozen for on, count in results)
    else:
        assert all(on and count == 0 for on, count in results)


@pytest.mark.distributed  # a fake world of 4 ranks, in a process of its own
def test_plan_recommends_a_fitting_layout_and_refuses_none_fits():
    before = choose_start_method("cpu")
    p = plan(_spec(4, checkpointing=(False,)), cluster("h100", 4, 1))
    # nothing of the fake world is left here: jobs launched from this process start as before
    assert not torch.distributed.is_initialized() and choose_start_method("cpu") == before
    labels = {q.layout.label for q in p.predictions}
    assert labels == {
        "ddp 4 mb1", "fsdp 4 mb1", "fsdp+tp 2x2 mb2", "tp 4 mb4", "pp 4 mb1", "pp 2 x dp 2 mb1", "pp 2 x tp 2 mb1",
    }  # fmt: skip
    # the pipeline's every stage traced and timed; its time a middle stage's, the slowest: a
    # block's compute, and it sends each of the 4 micro-batches' activations forward and their
    # gradients back
    pp = next(q for q in p.predictions if q.layout.mesh == "pp=4")
    assert pp.trace.computed[0].startswith("pp: every stage traced") and pp.trace.peak > 0
    assert sum(op.calls for op in pp.trace.ops if op.kind == "send") == 2 * 4
    # its FLOPs: the slowest stage's, a block's (the embedding's stage counts none), on all 4 samples
    blocks = flops(_spec().build, _spec().batch, False) - 3 * 2**20  # less the head's logits, 3 MFLOP a sample
    assert pp.trace.flops == pytest.approx(4 * blocks / 2) and "each stage timed on its own" in pp.trace.computed[1]
    assert pp.trace.computed[-1].startswith("flops: each stage's children's as counted")
    # beside tp: a tp rank's share of its stage's FLOPs
    split = next(q for q in p.predictions if q.layout.mesh == "pp=2,tp=2")
    assert split.trace.flops == pytest.approx(4 * (blocks / 2 + 3 * 2**20) / 2)  # a block and the head
    assert p.best is not None and p.best.fits
    assert "--nproc 4" in p.command(p.best)
    # the same traces on a GPU of almost no memory: none fits, and none is recommended
    tiny = cluster("h100", 4, 1, memory_gib=1e-4)
    again = [predict(q.trace, q.layout, tiny, 1e14, 4, 32, 1.0) for q in p.predictions]
    assert not any(q.fits for q in again) and best(again) is None
    assert "no layout fits" in output.report(replace(p, cluster=tiny, predictions=again))


@pytest.mark.distributed  # fake worlds of 2 ranks, in processes of their own
def test_a_smaller_micro_batch_is_tried_where_the_temporaries_do_not_fit():
    # a vocabulary of 50,000: the logits and their gradient, temporaries, are most of the peak at
    # mb16 (0.42 GiB); at mb1 the peak is below 0.1 GiB. Stopping at mb16 (as if temporaries were
    # states) said "no layout fits".
    spec = Spec("gpt", (32,), 50_000, 32, "bf16", "adamw", dict(GPT), (False,), strategies=("fsdp",))
    p = plan(spec, cluster("h100", 2, 1, memory_gib=0.1))
    assert p.best is not None and p.best.layout.micro_batch < 16, output.report(p)
    assert "--micro-batch-size" in p.command(p.best)


def _accumulated():
    spec = _spec()
    return trace(Step(spec.build, spec.batch, 2**40, "fp32", "adamw"), Layout("fsdp", "dp=2", False, 2**10), 2)


@pytest.mark.distributed  # a fake world of 2 ranks, in a process of its own
def test_a_step_of_a_billion_micro_batches_counts_its_collectives_without_listing_them():
    # --batch-size 2**40: each micro-batch's collectives were copied into a list, once per
    # micro-batch (2**30 here): the plan ran out of time and memory
    (traced,) = in_fake_worlds(2, [(_accumulated, ())])
    assert len(traced.ops) < 100 and sum(op.calls for op in traced.ops) > 2**30
    q = predict(traced, Layout("fsdp", "dp=2", False, 2**10), cluster("h100", 2), 1e14, 2**41, 32, 1.0)
    assert 0 < q.step_s < float("inf")


@pytest.mark.unit
def test_a_deep_gpt_is_counted_without_building_every_block():
    from ddpkit.models import gpt_parameters
    from ddpkit.plan.run import _size

    # 20,000 blocks took minutes to build, even on fake tensors: counted from 3 and 4 blocks
    spec = Spec("gpt", (32,), 256, 8, "fp32", "adamw", {**GPT, "depth": 20_000}, (False,))
    start = time.perf_counter()
    assert _size(spec)[0] == gpt_parameters(32, 256, 64, 20_000, heads=4)
    assert time.perf_counter() - start < 30  # built whole: over 100 s on a 2-core machine


@pytest.mark.unit
def test_report_names_a_classifiers_rate_in_samples_and_shows_small_figures():
    from ddpkit.plan.predict import Prediction
    from ddpkit.plan.run import Plan
    from ddpkit.plan.trace import CATEGORIES, Trace

    trace = Trace(dict.fromkeys(CATEGORIES, 0.0), 3e6, [], 0.0)  # 3 MB
    q = Prediction(Layout("ddp", "dp=2", False, 4), trace, 40.0, 0.0, 0.0, 40.0, 0.2, None, 0.003, False)
    spec = Spec("cnn", (3, 32, 32), 10, 8, "bf16", "adamw")
    text = output.report(Plan(spec, cluster("h100", 2, 1, memory_gib=1e-6), 1000, [q], 0.1))
    # a classifier's rate is samples, not tokens; 0.1 a GPU was printed as 0, and the 3 MB
    # that do not fit in 1e-06 GiB as "needs 0.0 GiB"
    assert "samples/s/GPU" in text and "tokens/s" not in text
    assert " 0.1 " in text.splitlines()[3] and "needs 0.00279 GiB per GPU of 1e-06" in text


def _cnn_trace(backend):
    spec = Spec("cnn", (3, 16, 16), 10, 8, "bf16", "adamw")
    return trace(Step(spec.build, spec.batch, 2, "bf16", "adamw", backend=backend), Layout("fsdp", "dp=4", False, 2), 4)


@pytest.mark.distributed  # a fake world of 4 ranks, in a process of its own
def test_a_gloo_trace_holds_the_copy_its_reduce_scatter_makes():
    nccl, gloo = in_fake_worlds(4, [(_cnn_trace, ("nccl",)), (_cnn_trace, ("gloo",))])
    # the CNN's largest unit, Linear(1024, 128), reduce-scatters its gradients in fp32 (the
    # policy's reduce dtype): gloo's copy of that input beside the input and a rank's output
    grads = (1024 * 128 + 128) * 4
    assert gloo.memory["communication"] >= grads  # the reduce-scatter's input
    assert gloo.memory["temporary"] >= grads + grads / 4  # gloo's copy and the output
    assert gloo.peak > nccl.peak
    assert [op.kind for op in gloo.ops] == [op.kind for op in nccl.ops]  # a copy, not a collective
    assert any("gloo" in line for line in gloo.computed) and not any("gloo" in line for line in nccl.computed)


def _whole_and_extrapolated(layout):
    from ddpkit.plan import run

    spec = Spec("gpt", (32,), 256, 8, "fp32", "adamw", {"width": 64, "depth": 10, "heads": 4})
    step = Step(spec.build, spec.batch, 8 // layout.spec.data_size, "fp32", "adamw", count=True)
    return trace(step, layout, 4), run._traced(spec, step, layout, 4)


@pytest.mark.distributed  # a fake world of 4 ranks, in a process of its own
def test_deep_gpt_extrapolated_from_three_and_four_blocks_matches_whole_traces():
    layouts = [
        Layout("fsdp", "dp=4", False, 2),
        Layout("ddp", "dp=4", False, 2),
        # with checkpointing the moment of the peak moves up to 4 blocks, and FSDP2's buffers
        # grow from 2 to 3 blocks only; the peaks' difference alone once gave negative peaks
        Layout("fsdp", "dp=4", True, 2),
        Layout("tp", "dp=2,tp=2", True, 4),
        Layout("tp", "tp=4", False, 8),
    ]
    for whole, guessed in in_fake_worlds(4, [(_whole_and_extrapolated, (layout,)) for layout in layouts]):
        assert guessed.peak == pytest.approx(whole.peak, rel=0.01)
        assert min(guessed.memory.values()) >= 0
        # as many collectives, moving as many bytes (per block under fsdp; DDP's one all-reduce
        # of every gradient grows with the model instead)
        assert sum(op.calls for op in guessed.ops) == sum(op.calls for op in whole.ops)
        moved = [sum(op.bytes * op.calls for op in t.ops) for t in (guessed, whole)]
        assert moved[0] == pytest.approx(moved[1], rel=1e-3)
        # every operation the CPU's time model counts, of the same sizes: those over the whole
        # model (the optimizer's multi-tensor step, DDP's bucket copies) grown with it
        assert guessed.work.counts == whole.work.counts


def _stage_whole_and_extrapolated(layout, index):
    from ddpkit.plan import run
    from ddpkit.plan.pipeline import trace_stage

    spec = Spec("gpt", (32,), 256, 4, "fp32", "adamw", {"width": 64, "depth": 9, "heads": 4})
    step = Step(spec.build, spec.batch, 4 // layout.spec.data_size, "fp32", "adamw", count=True)  # two micro-batches
    world = layout.spec.processes
    return trace_stage(step, layout, world, index), run._traced_stage(spec, step, layout, world, index)


@pytest.mark.distributed  # fake worlds of 2, 4 and 8 ranks, in processes of their own
def test_a_deep_gpts_pipeline_stages_extrapolated_from_fewer_blocks_match_whole_stage_traces():
    # 9 blocks over 2 stages: the embedding and 4 blocks, then 5 blocks and the head (cut by
    # parameters); each traced at 2 and 3 blocks (3 and 4 under checkpointing) and extrapolated
    pp, checkpointed, beside = (
        Layout("pp", "pp=2", False, 2),
        Layout("pp", "pp=2", True, 2),
        Layout("pp", "pp=2,dp=2", False, 1),
    )
    cube = Layout("pp", "pp=2,dp=2,tp=2", False, 1)  # 3-D: FSDP2's buffers do not grow with the blocks, DDP's do
    calls = [(_stage_whole_and_extrapolated, (layout, s)) for layout, s in ((pp, 0), (pp, 1), (checkpointed, 1))]
    pairs = (
        in_fake_worlds(2, calls)
        + in_fake_worlds(4, [(_stage_whole_and_extrapolated, (beside, 1))])
        + in_fake_worlds(8, [(_stage_whole_and_extrapolated, (cube, 1))])
    )
    for whole, guessed in pairs:
        assert guessed.peak == pytest.approx(whole.peak, rel=0.01)
        assert min(guessed.memory.values()) >= 0
        for role in ("parameters", "optimizer", "communication"):  # states: exact
            assert guessed.memory[role] == pytest.approx(whole.memory[role], rel=1e-6), role
        # as many calls, moving as many bytes (FSDP2's to a few bytes: it pads each unit's shards),
        # in the same groups
        for kind, rel in (("send", 0), ("all_reduce", 0), ("all_gather", 1e-4), ("reduce_scatter", 1e-4)):
            moved = [
                [(op.ranks, op.bytes * op.calls, op.calls) for op in t.ops if op.kind == kind] for t in (guessed, whole)
            ]
            assert {r for r, _, _ in moved[0]} == {r for r, _, _ in moved[1]}, kind
            assert sum(b for _, b, _ in moved[0]) == pytest.approx(sum(b for _, b, _ in moved[1]), rel=rel), kind
            assert sum(c for _, _, c in moved[0]) == sum(c for _, _, c in moved[1]), kind
        assert "extrapolated" in guessed.computed[-1]
        assert guessed.work.counts == whole.work.counts  # every operation counted, of the same sizes


def _stage_made_ready_and_after_a_whole_first_step(layout, index, precision):
    from unittest import mock

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from ddpkit.plan import pipeline

    spec = Spec("gpt", (32,), 256, 8, precision, "adamw", dict(GPT))
    step = Step(spec.build, spec.batch, spec.share(layout.spec.data_size), precision, "adamw", count=True)
    traced, steps = [], []
    run_step = PipelineScheduleSingle.step

    def counted(schedule, *args, **kwargs):  # each step's micro-batches
        steps[-1].append(schedule._n_microbatches)
        return run_step(schedule, *args, **kwargs)

    # The plan's first, in a process that has traced nothing: under tp, DTensor's caches are
    # as cold as a plan's first trace finds them (a run's whole first step warms them all)
    for first_step in (pipeline.ready, lambda steps, one_step, *_: one_step(steps._n_microbatches)):
        steps.append([])
        with (
            mock.patch.object(pipeline, "ready", first_step),
            mock.patch.object(PipelineScheduleSingle, "step", counted),
        ):
            traced.append(pipeline.trace_stage(step, layout, layout.spec.processes, index))
    return *traced, steps


@pytest.mark.distributed  # fake worlds of 4 and 8 ranks, in processes of their own
def test_a_stage_made_ready_without_a_whole_first_step_traces_as_after_one():
    # A stage's schedule makes its buffers at its first step; the plan makes them alone before
    # the tracked step (`pipeline.ready`), and under tp runs a step of two micro-batches first
    cases = [
        (Layout("pp", "pp=4", False, 1), 0, "fp32"),  # the first stage, 4 micro-batches in flight
        (Layout("pp", "pp=4", False, 1), 3, "fp32"),  # the last, with the loss
        (Layout("pp", "pp=2,dp=2", True, 2, "gpipe"), 1, "bf16"),  # gpipe, checkpointing, autocast, dp
        (Layout("pp", "pp=2,tp=2", False, 1), 0, "fp32"),  # tp: a step of one micro-batch left some out
        (Layout("pp", "pp=2,dp=2,tp=2", True, 1), 1, "fp32"),  # 3-D, FSDP2's accumulation
    ]
    results = []
    for case in cases:  # each in a process of its own
        results += in_fake_worlds(case[0].spec.processes, [(_stage_made_ready_and_after_a_whole_first_step, case)])
    for (layout, index, _), (ready, whole, steps) in zip(cases, results):
        chunks = steps[1][0]
        assert steps[1] == [chunks, chunks], (layout.label, index)  # a run's: two whole steps
        # the tracked step alone, made ready; under tp after a step of two micro-batches (of more)
        tp = layout.spec.size("tp") > 1
        assert steps[0] == ([2, chunks] if tp else [chunks]) and chunks > 2 * tp, (layout.label, index)
        assert whole.peak > 0 and ready.memory == whole.memory, (layout.label, index)
        assert ready.ops == whole.ops and ready.work.counts == whole.work.counts, (layout.label, index)


def _traced_twice(layout, share):
    spec = Spec("gpt", (32,), 256, 8, "fp32", "adamw", dict(GPT))
    step = Step(spec.build, spec.batch, share, "fp32", "adamw", count=True)
    return [trace(step, layout, layout.spec.processes) for _ in range(2)]


@pytest.mark.distributed  # a fake world of 4 ranks, in a process of its own
def test_a_tensor_parallel_trace_first_in_its_process_is_as_every_later_one():
    # DTensor's first sharding of each operation runs on fake tensors, which the trace's warm-up
    # step takes out of the tracked step (`trace._warm_up`); under accumulation that warm-up
    # runs a micro-batch without the gradients' reduction too, as the step does (with one
    # alone, this first trace peaked 5.6% above the later one)
    ((first, later),) = in_fake_worlds(4, [(_traced_twice, (Layout("tp", "dp=2,tp=2", False, 1), 4))])
    assert first.peak > 0 and first.memory == later.memory
    assert first.ops == later.ops and first.work.counts == later.work.counts


def _stage_whole_and_over_fewer_micro_batches(layout, index):
    from ddpkit.plan import run
    from ddpkit.plan.pipeline import trace_stage

    stages = layout.spec.size("pp")
    spec = Spec("gpt", (16,), 64, 64, "fp32", "adamw", {"width": 16, "depth": 2, "heads": 2})
    step = Step(spec.build, spec.batch, 2 * (stages + 2) + 1, "fp32", "adamw", count=True)  # micro-batches of 1
    world = layout.spec.processes
    guessed = run._over_micro_batches(step, layout, world, index)  # first in its process, as in a plan
    return trace_stage(step, layout, world, index), guessed


@pytest.mark.distributed  # fake worlds of 6 and 8 ranks, in processes of their own
def test_a_stage_over_many_micro_batches_extrapolated_from_fewer_equals_its_whole_trace():
    # Under 1f1b each micro-batch from P + 1 on adds the same to a stage: traced at P + 1 and
    # P + 2 and extrapolated to 2P + 5: the first stage (the last to settle) beside dp (DDP), the
    # last with checkpointing beside tp, and in 3-D the first (FSDP2's collectives)
    pairs = in_fake_worlds(
        6,
        [
            (_stage_whole_and_over_fewer_micro_batches, (Layout("pp", "pp=3,dp=2", False, 1), 0)),
            (_stage_whole_and_over_fewer_micro_batches, (Layout("pp", "pp=3,tp=2", True, 1), 2)),
        ],
    ) + in_fake_worlds(8, [(_stage_whole_and_over_fewer_micro_batches, (Layout("pp", "pp=2,dp=2,tp=2", False, 1), 0))])
    for whole, guessed in pairs:
        assert "micro-batches, extrapolated" in guessed.computed[-1]
        assert guessed.peak == pytest.approx(whole.peak, rel=1e-9)
        assert guessed.memory == pytest.approx(whole.memory, rel=1e-9, abs=1e-6)
        assert guessed.work.counts == whole.work.counts  # every operation counted, of the same sizes
        totals = [{}, {}]
        for ops, total in zip((guessed.ops, whole.ops), totals):
            for op in ops:
                calls, moved = total.get((op.kind, op.ranks), (0, 0))
                total[op.kind, op.ranks] = (calls + op.calls, moved + op.bytes * op.calls)
        assert totals[0].keys() == totals[1].keys()
        for key, (calls, moved) in totals[1].items():  # (FSDP2's to a few bytes: each call given one size)
            assert totals[0][key][0] == calls and totals[0][key][1] == pytest.approx(moved, rel=1e-4), key


@pytest.mark.unit
def test_a_posed_stage_is_extended_only_from_peaks_that_hold_its_micro_batches_in_flight():
    from ddpkit.plan.run import _affine

    def at(k, optimizer_peak=False):  # a stage's roles at its peak with k micro-batches in flight
        if optimizer_peak:  # the optimizer's step: the same whatever is in flight
            return Trace(
                {"parameters": 100.0, "optimizer": 300.0, "activations": 40.0, "temporary": 60.0}, 500.0, [], 0.0
            )
        return Trace(
            {"parameters": 100.0, "optimizer": 200.0, "activations": 50.0 * k, "temporary": 30.0}, 0.0, [], 0.0
        )

    assert _affine(at(2), at(3), at(4))
    assert not _affine(at(2, True), at(3, True), at(4, True))  # on a line, but more in flight overtake it
    assert not _affine(at(2, True), at(3), at(4))  # the moment moved between them
    assert not _affine(at(2), at(3), at(4, True))


def _posed_and_whole(layout, stages_whole):
    from ddpkit.plan import run
    from ddpkit.plan.pipeline import trace_stage

    stages = layout.spec.size("pp")
    spec = Spec("gpt", (16,), 64, 64, "fp32", "adamw", {"width": 16, "depth": 6, "heads": 2})
    step = Step(spec.build, spec.batch, stages + 4, "fp32", "adamw", count=True)  # P + 4 micro-batches of 1
    world = layout.spec.processes
    planned, traced, posed = run._stage_traces(spec, step, layout, world, run.stage_cuts(spec, stages))
    return traced, posed, [(s, planned[s], trace_stage(step, layout, world, s)) for s in stages_whole]


@pytest.mark.distributed  # fake worlds of 16 and 32 ranks, in processes of their own
def test_a_deep_pipelines_stages_posed_where_few_are_in_flight_equal_their_whole_traces():
    # From POSED_FROM stages on, a stage's children are traced where a stage holds 2, 3 and 4
    # micro-batches in flight (the first stage as the first of 2, 3 and 4 stages, a middle one as
    # stages P - 2 to P - 4) and the last in its place, over 5 and 6 micro-batches, then extended
    # to its own in flight and the step's P + 4: a 6-block gpt over 8 stages (a block each
    # between the embedding and the head), beside dp with checkpointing (DDP's all-reduce over the
    # stage's own ranks), and in 3-D (FSDP2's collectives), against whole traces in their places
    from ddpkit.plan import run

    assert run.POSED_FROM == 8
    ((traced, posed, pairs),) = in_fake_worlds(
        16, [(_posed_and_whole, (Layout("pp", "pp=8,dp=2", True, 1), (0, 1, 7)))]
    )
    ((traced_3d, posed_3d, pairs_3d),) = in_fake_worlds(
        32, [(_posed_and_whole, (Layout("pp", "pp=8,dp=2,tp=2", False, 1), (0, 2)))]
    )
    ((traced_1d, posed_1d, pairs_1d),) = in_fake_worlds(8, [(_posed_and_whole, (Layout("pp", "pp=8", False, 1), (0,)))])
    assert traced == traced_3d == traced_1d == [] and posed and posed_3d and posed_1d
    for s, guessed, whole in pairs + pairs_3d + pairs_1d:  # (pp alone: the first stage's sends over the world)
        assert "posed" in guessed.computed[-1] and guessed.computed[0] == f"pp: stage {s} of 8"
        assert guessed.peak == pytest.approx(whole.peak, rel=1e-9), s
        assert guessed.memory == pytest.approx(whole.memory, rel=1e-9, abs=1e-6), s
        assert guessed.work.counts == whole.work.counts, s
        totals = [{}, {}]
        for ops, total in zip((guessed.ops, whole.ops), totals):
            for op in ops:
                calls, moved = total.get((op.kind, op.ranks), (0, 0))
                total[op.kind, op.ranks] = (calls + op.calls, moved + op.bytes * op.calls)
        assert totals[0].keys() == totals[1].keys(), s  # (DDP's all-reduce over the stage's own ranks)
        for key, (calls, moved) in totals[1].items():  # (FSDP2's to a few bytes: each call given one size)
            assert totals[0][key][0] == calls and totals[0][key][1] == pytest.approx(moved, rel=1e-4), key


def _planned_and_whole_stage_2(layout):
    from ddpkit.plan import run
    from ddpkit.plan.pipeline import trace_stage

    spec = Spec("gpt", (32,), 256, 16, "fp32", "adamw", {"width": 32, "depth": 4, "heads": 2})
    step = Step(spec.build, spec.batch, 16 // layout.spec.data_size, "fp32", "adamw")
    world, stages = layout.spec.processes, layout.spec.size("pp")
    planned, traced, _ = run._stage_traces(spec, step, layout, world, run.stage_cuts(spec, stages))
    return planned, traced, trace_stage(step, layout, world, 2)


@pytest.mark.distributed  # fake worlds of 10 and 20 ranks, in processes of their own
def test_a_pipelines_stages_alike_are_traced_at_both_ends_and_between_equal_their_whole_traces():
    # gpt of 4 blocks over 5 stages: the embedding; a block on each of stages 1 to 3; the last
    # block and the head. Under 1f1b stages 1 to 3 hold 4, 3 and 2 micro-batches in flight:
    # stages 1 and 3 traced, stage 2 interpolated between them, its DDP all-reduce (pp x dp)
    # over its own ranks. Under gpipe all 8 of the step on every stage: stage 1 traced, 2 and 3
    # as it, FSDP2's and tp's collectives (3-D) as traced.
    one_f, gpipe = Layout("pp", "pp=5,dp=2", False, 1), Layout("pp", "pp=5,dp=2,tp=2", False, 1, "gpipe")
    ((planned, traced, whole),) = in_fake_worlds(10, [(_planned_and_whole_stage_2, (one_f,))])
    ((planned_g, traced_g, whole_g),) = in_fake_worlds(20, [(_planned_and_whole_stage_2, (gpipe,))])
    assert traced == [0, 1, 3, 4] and traced_g == [0, 1, 4] and len(planned) == len(planned_g) == 5
    for layout, guessed, real in ((one_f, planned[2], whole), (gpipe, planned_g[2], whole_g)):
        assert guessed.peak == pytest.approx(real.peak, rel=1e-9), layout.label
        assert guessed.memory == pytest.approx(real.memory, rel=1e-9, abs=1e-6), layout.label
        assert sorted(map(repr, guessed.ops)) == sorted(map(repr, real.ops)), layout.label
    assert "interpolated between stages 1 and 3" in planned[2].computed[-1] and planned[2].peak != planned[1].peak
    assert "as stage 1" in planned_g[2].computed[-1] and planned_g[3].peak == planned_g[1].peak
    ddp = [op for op in planned[2].ops if op.kind == "all_reduce"]
    assert ddp and all(op.ranks == (4, 5) for op in ddp)  # stage 2's two data ranks


@pytest.mark.cli
def test_cli_prints_table_and_command_and_writes_json_and_plot(tmp_path, cli):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    proc = cli(
        "plan",
        "--gpt-width",
        "64",
        "--gpt-depth",
        "2",
        "--gpt-heads",
        "4",
        "--seq-len",
        "32",
        "--batch-size",
        "16",
        "--gpus-per-node",
        "2",
        "--nodes",
        "2",
        "--activation-checkpointing",
        "off",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fastest that fits:" in proc.stdout and "ddpkit train --model gpt" in proc.stdout
    assert "--nnodes 2" in proc.stdout
    record = json.loads(out.read_text())
    names = [row["layout"] for row in record["layouts"]]
    assert any(n.startswith("hsdp 2x2") for n in names)
    assert record["recommended"]["command"] in proc.stdout
    assert png.stat().st_size > 10_000


@pytest.mark.cli
def test_cli_exits_1_when_no_layout_fits_and_still_writes_its_files(tmp_path, cli):
    # A script could not tell "no layout fits" from a recommendation: both exited 0. Now 1, as
    # find-batch-size does when no size fits; the table, --json and --plot still say why.
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    small = ("--gpt-width", "32", "--gpt-depth", "1", "--gpt-heads", "2", "--seq-len", "16", "--batch-size", "4")
    flags = ("--gpus-per-node", "2", "--strategy", "ddp", "--activation-checkpointing", "off")
    proc = cli("plan", *small, *flags, "--memory-gib", "0.0001", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no layout fits: the smallest, ddp 2" in proc.stdout and "Traceback" not in proc.stderr
    assert json.loads(out.read_text())["recommended"] is None and png.stat().st_size > 10_000


# A model of one's own whose constructor raises, for the bad-input table.
BROKEN_MODEL = """
def raises(in_shape, num_classes):
    raise RuntimeError("boom")
"""

BAD = [
    (["--gpu", "b300"], "--gpu 'b300'"),
    # (fp16: no pipeline, which would run any batch)
    (["--batch-size", "3", "--gpus-per-node", "4", "--gpt-heads", "2", "--precision", "fp16"], "does not divide"),
    (["--gpt-width", "30", "--gpt-heads", "4"], "multiple of --gpt-heads"),
    (["--efficiency", "2"], "--efficiency"),
    (["--efficiency", "0"], "--efficiency"),
    (["--peak-tflops", "1e300"], "--peak-tflops"),
    (["--inter-gbps", "0"], "--inter-gbps"),
    (["--model", "cnn", "--data", "text"], "--data text"),
    (["--model", "cnn", "--data", "synthetic", "--num-classes", "1"], "--num-classes"),
    (["--nodes", "0"], "--nodes"),
    (["--plot", "plan.svg"], "--plot"),
    (["--json", "."], "is a directory"),
    (["--json", ""], "--json"),
    (["--json", "same.png", "--plot", "same.png"], "same file"),
    (["--json", "same.png", "--plot", "./same.png"], "same file"),  # however spelled: the plot replaced the JSON
    (["--json", "pipe.json"], "pipe.json: not a regular file"),  # a fifo: written beside and renamed over it
    (["--verify-nproc", "2"], "--verify-nproc goes with --verify"),
    (["--verify", "--verify-nproc", "0"], "--verify-nproc"),
    (["--model", "broken_model:raises", "--data", "cifar10"], "boom"),
    # this machine's CPU: measured, so none of its figures can be given, nor more processes than fit
    (["--gpu", "cpu", "--nodes", "2"], "--gpu cpu is this machine"),
    (["--gpu", "cpu", "--peak-tflops", "10"], "--peak-tflops cannot be given"),
    (["--gpu", "cpu", "--efficiency", "0.4"], "--efficiency cannot be given"),  # the default's value too: measured
    (["--gpu", "cpu", "--gpus-per-node", "100000"], "in each of 100000 processes"),
    (["--gpt-style", "llama", "--gpt-heads", "4", "--gpt-kv-heads", "3"], "--gpt-kv-heads 3"),
    (["--strategy", "hsdp"], "--strategy hsdp: no such layout"),
]


@pytest.mark.cli
def test_cli_bad_input_is_one_line_and_exit_2_before_any_plan(tmp_path):
    from tests.cli.argv_runner import run_batch

    (tmp_path / "broken_model.py").write_text(BROKEN_MODEL)
    os.mkfifo(tmp_path / "pipe.json")  # as /dev/null is a device, which a plan run as root replaced
    results = run_batch([{"argv": ["plan", *flags], "cwd": str(tmp_path)} for flags, _ in BAD], path=str(tmp_path))
    for (flags, says), r in zip(BAD, results):
        assert r["code"] == 2, (flags, r["stderr"][-2000:])
        assert says in r["stderr"] and len(r["stderr"].strip().splitlines()) == 1, (flags, r["stderr"])
        assert r["seconds"] < 20, flags  # refused before anything is traced


@pytest.mark.cli
@pytest.mark.slow
def test_cli_verify_that_cannot_fit_here_is_one_line_and_exit_2_after_the_plan(tmp_path, cli):
    # --verify runs the layout for real: where its processes' traced peaks alone exceed what the
    # machine has free, it is refused before any process starts. The plan is printed and its
    # JSON written first: nothing is lost.
    out = tmp_path / "plan.json"
    proc = cli(
        "plan", "--gpt-width", "64", "--gpt-depth", "2", "--gpt-heads", "4", "--seq-len", "32", "--batch-size", "16",
        "--gpus-per-node", "2", "--activation-checkpointing", "off", "--json", str(out), "--strategy", "ddp",
        "--verify", "--verify-nproc", "20000",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and "--verify's run of ddp 20000" in said[0] and "in each of 20000 processes" in said[0], said
    assert "fastest that fits:" in proc.stdout and json.loads(out.read_text())["layouts"]


@pytest.mark.distributed  # fake worlds of 2 ranks, in processes of their own
def test_a_pipelines_verification_runs_a_stage_per_process_and_is_refused_where_its_stages_cannot_fit():
    from ddpkit.errors import UsageError
    from ddpkit.plan.verify import compare, here, processes

    planned = Layout("pp", "pp=4", False, 2)
    assert (processes(planned, 8), processes(planned, 2), processes(Layout("ddp", "dp=8", False, 2), 8)) == (4, 2, 8)
    spec, layout = here(_spec(16), planned, 2)
    assert (layout.mesh, layout.micro_batch, spec.global_batch) == ("pp=2", 2, 16)
    with pytest.raises(UsageError, match=r"--verify on 5 process\(es\): pp 4 mb2 runs here .* from 2 to 4"):
        here(_spec(16), planned, 5)  # 8 micro-batches, but the model's 4 children: not 5 stages
    with pytest.raises(UsageError, match=r"from 2 to 2 "):
        here(_spec(4), planned, 1)  # one process is no pipeline
    # pipelines beside each other: as many as the processes hold whole, else one of a stage per process
    beside = Layout("pp", "pp=2,dp=4", False, 2)
    assert (processes(beside, 8), processes(beside, 4), processes(beside, 3)) == (8, 4, 2)
    spec, layout = here(_spec(16), beside, 4)  # 4 rows to each pipeline planned, and here
    assert (layout.mesh, layout.micro_batch, spec.global_batch) == ("pp=2,dp=2", 2, 8)
    spec, layout = here(_spec(16), beside, 2)
    assert (layout.mesh, layout.micro_batch, spec.global_batch) == ("pp=2", 2, 4)
    with pytest.raises(
        UsageError, match=r"pp 2 x dp 4 mb2 runs here .* from 2 to 2 .* side by side on a multiple of 2;"
    ):
        here(_spec(16), beside, 3)  # a pipeline's 4 rows, in micro-batches of 2: 2 stages at most
    # gpipe's fewer micro-batches than stages: so run here too, on up to the model's children
    spec, layout = here(_spec(2), Layout("pp", "pp=4", False, 2, "gpipe"), 3)
    assert (layout.mesh, layout.schedule, spec.global_batch) == ("pp=3", "gpipe", 2)
    # a pipeline beside tp: as planned, on its processes; in 3-D, as many pipelines as the
    # processes hold
    across = Layout("pp", "pp=2,tp=2", False, 2)
    assert (processes(across, 8), processes(across, 2)) == (4, 4)
    spec, layout = here(_spec(16), across, 4)
    assert (layout.mesh, layout.micro_batch, spec.global_batch) == ("pp=2,tp=2", 2, 16)
    with pytest.raises(UsageError, match=r"^--verify on 2 process\(es\): pp 2 x tp 2 mb2 runs here as pipelines"):
        here(_spec(16), across, 2)
    cube = Layout("pp", "pp=2,dp=4,tp=2", False, 2)
    assert (processes(cube, 64), processes(cube, 8), processes(cube, 2)) == (16, 8, 4)
    spec, layout = here(_spec(64), cube, 8)  # 16 rows to each of 4 pipelines planned; 2 of them here
    assert (layout.mesh, layout.micro_batch, spec.global_batch) == ("pp=2,dp=2,tp=2", 2, 32)
    assert here(_spec(64), cube, 4)[1].mesh == "pp=2,tp=2"
    with pytest.raises(UsageError, match=r"give --verify-nproc 4 \(or a multiple of it up to 16\)$"):
        here(_spec(64), cube, 6)
    # a vocabulary and batch whose logits no machine here holds: the stage that holds most is
    # refused before any process starts
    big = Spec("gpt", (32,), 2**17, 2**16, "fp32", "adamw", dict(GPT), (False,))
    with pytest.raises(UsageError, match=r"^--verify's run of pp 2 mb32768 needs about [\d,.]+ GiB"):
        compare(here(big, Layout("pp", "pp=2", False, 2**15), 2), 2, "cpu")


@pytest.mark.unit
def test_a_verification_is_refused_where_its_peaks_cannot_fit():
    from ddpkit.core.memory import available_mib
    from ddpkit.errors import UsageError
    from ddpkit.plan.verify import fits_here

    free = available_mib() * 2**20
    fits_here(free / 8, 4, "cpu", "four processes of an eighth")
    with pytest.raises(UsageError, match=r"two processes of two thirds needs about .* in each of 2 processes"):
        fits_here(free * 2 / 3, 2, "cpu", "two processes of two thirds")


@pytest.mark.cli
@pytest.mark.slow
def test_cli_plans_for_this_machines_cpu_measured_first(cli):
    """`--gpu cpu`: the cluster is this machine's CPU with --gpus-per-node processes, measured
    (calibrate.measure), and the plan says how it times each step; the command runs on the CPU."""
    proc = cli(
        "plan", "--gpu", "cpu", "--gpus-per-node", "2", "--gpt-width", "32", "--gpt-depth", "2", "--seq-len", "32",
        "--batch-size", "8", "--activation-checkpointing", "off", "--precision", "fp32", "--strategy", "ddp,fsdp",
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # (torch 2.13 warned of each collective's old name)
    out = proc.stdout
    assert "CPU process (of 2 here, measured)" in out and "compute (measured here)" in out
    assert "overlap: none" in out and "ddp 2 mb4" in out and "fsdp 2 mb4" in out
    assert "--device cpu --nproc 2" in out


@pytest.mark.unit
def test_a_deep_pipelines_posed_sets_trace_what_they_share_once():
    # A 34-block gpt over 8 stages: middle sets of 4 and 5 blocks, each posed from its children
    # traced at 2 and 3 blocks in the same places: those traces run once (`_posed_stages`'
    # memo). The traces here are stand-ins whose every role is affine in the blocks, the
    # micro-batches in flight and the step's, so each stage's extension is known exactly.
    from unittest import mock

    from ddpkit.plan import pipeline, run

    spec = Spec("gpt", (32,), 256, 16, "fp32", "adamw", {"width": 16, "depth": 34, "heads": 2})
    step, layout = Step(spec.build, spec.batch, 16, "fp32", "adamw"), Layout("pp", "pp=8", False, 1)
    cuts = run.stage_cuts(spec, 8)
    assert sorted({blocks for embed, blocks, head in cuts if not embed and not head}) == [4, 5]

    def held(blocks, embed, head, in_flight, m):
        return {
            "parameters": 10.0 * blocks + 1000 * embed + 2000 * head,
            "gradients": 5.0 * blocks,
            "optimizer": 20.0 * blocks,
            "activations": 100.0 * blocks * in_flight + 7.0 * blocks * m,
            "temporary": 50.0,
            "communication": 0.0,
        }

    calls = []

    def stand_in(step, layout, world_size, index, kept=None, posed=None):
        calls.append((step.share, index, kept, posed))
        blocks = sum(name.startswith("block") for name in kept)
        memory = held(blocks, "embed" in kept, "head" in kept, posed or 8 - index, step.share)
        return Trace(memory, sum(memory.values()), [], 0.0, [f"pp: stage {index} of 8"])

    with mock.patch.object(pipeline, "trace_stage", stand_in):
        out, in_place, posed = run._stage_traces(spec, step, layout, 8, cuts)
    assert posed and in_place == []
    assert len(calls) == len(set(calls)) == 4 + 4 * 2 + 2  # the first set's 4; the middle sets' 8, once; the last's 2
    for s, ((embed, blocks, head), stage) in enumerate(zip(cuts, out)):
        assert stage.memory == pytest.approx(held(blocks, embed, head, 8 - s, 16)), s
