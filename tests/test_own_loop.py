"""A user's own loop through `Runtime`: a padding collate, a DataLoader handed to rt.loader,
token-weighted updates, full-state save and resume mid-epoch, main_first. Every feature on 1, 2
and 3 gloo processes, compared across world sizes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from ddpkit.errors import UsageError
from tests import own_loop
from tests.data.streams import Stream, expected
from tests.test_runtime import WORLD_SIZE_ATOL


@pytest.mark.distributed
def test_token_weighted_updates_equal_the_one_process_token_mean_on_1_2_and_3_processes():
    # 30 sequences of 1-8 tokens, global batch 7: shares of 3/2/2 samples hold very different
    # numbers of tokens; micro-batches of 2 split them further.
    reference = own_loop.plain_token_mean(6, 7)
    one = own_loop.token_weighted(6, 7, micro=2)
    torch.testing.assert_close(one["params"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
    # Without the weight every micro-batch's mean counts by samples: a different update, so
    # the comparison above can fail.
    by_samples = own_loop.token_weighted(6, 7, micro=2, weighted=False)
    assert (by_samples["params"] - reference).abs().max() > 1e-4
    for nproc in (2, 3):
        out = ddpkit.launch(own_loop.token_weighted, 6, 7, 2, nproc=nproc)
        for r in range(nproc):
            torch.testing.assert_close(out[r]["params"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
            assert out[r]["position"] == one["position"]


@pytest.mark.distributed
def test_a_dataloader_handed_to_rt_loader_keeps_its_collate_and_reads_its_batch_size_as_global():
    one = own_loop.token_weighted(5, 7, micro=None)
    assert own_loop.token_weighted(5, 7, micro=None, via_dataloader=True)["params"].equal(one["params"])
    for nproc in (2, 3):
        out = ddpkit.launch(own_loop.token_weighted, 5, 7, None, via_dataloader=True, nproc=nproc)
        for r in range(nproc):
            torch.testing.assert_close(out[r]["params"], one["params"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.unit
@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda d: DataLoader(d, batch_size=4, sampler=DistributedSampler(d, num_replicas=2, rank=0)),
            "DistributedSampler",
        ),
        (lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]), "batch_sampler"),
        (lambda d: DataLoader(d, batch_size=None), "no batch_size"),
        (
            lambda d: DataLoader(d, batch_size=2, sampler=torch.utils.data.RandomSampler(d, replacement=True)),
            "RandomSampler",
        ),
    ],
    ids=["distributed-sampler", "batch-sampler", "no-batch-size", "with-replacement"],
)
def test_a_dataloader_whose_sampler_would_decide_the_shares_is_refused_in_one_line(make, says):
    data = TensorDataset(torch.arange(8.0))
    with ddpkit.Runtime(device="cpu") as rt, pytest.raises(UsageError, match=says) as err:
        rt.loader(make(data))
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_a_dataset_without_batch_size_is_refused_and_a_collate_cannot_be_resident():
    data = TensorDataset(torch.arange(8.0))
    with ddpkit.Runtime(device="cpu") as rt:
        with pytest.raises(UsageError, match="batch_size"):
            rt.loader(data)
        with pytest.raises(UsageError, match="collate_fn"):
            rt.loader(data, batch_size=4, resident=True, collate_fn=lambda s: s)


@pytest.mark.unit
def test_an_eval_loader_over_a_dataloader_keeps_its_batch_size_and_collate():
    data = own_loop.Sequences(10)
    with ddpkit.Runtime(device="cpu") as rt:
        loader = rt.eval_loader(DataLoader(data, batch_size=4, shuffle=True, collate_fn=own_loop.pad))
        batches = list(loader)
    assert [len(x) for x, _ in batches] == [4, 4, 2]  # in dataset order, padded per batch
    assert torch.equal(batches[0][1][0, : len(data[0][1])], data[0][1])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_custom_loop_stopped_mid_epoch_resumes_bit_identical_on_the_same_n(tmp_path, nproc):
    # 29 sequences in global batches of 6: 5 steps an epoch. Stop at step 7 (epoch 2, mid-way),
    # resume, end at step 12. Dropout makes the random streams matter. On 3 processes the
    # resumed run's first all-reduce must run in the bucket layout of the straight run's step 8
    # (strategy.settled_backward): else its sums differ in the last bits.
    path = str(tmp_path / "state.pt")
    straight = ddpkit.launch(own_loop.custom_loop, None, 12, path, dropout=0.3, nproc=nproc)
    stopped = ddpkit.launch(own_loop.custom_loop, 7, 12, path, dropout=0.3, nproc=nproc)
    assert stopped[0]["position"] == {"epoch": 1, "position": 2}
    resumed = ddpkit.launch(own_loop.custom_loop, None, 12, path, resume=True, dropout=0.3, nproc=nproc)
    for r in range(nproc):
        assert resumed[r]["params"].equal(straight[r]["params"])
        assert resumed[r]["position"] == straight[r]["position"]
        assert resumed[r]["lr"] == straight[r]["lr"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "weight,checkpointed", [(False, False), (True, False), (False, True)], ids=["as-given", "weighted", "checkpointed"]
)
def test_the_first_backward_on_three_ranks_reduces_once_and_leaves_other_leaves_alone(weight, checkpointed):
    # It runs twice (strategy.settled_backward): a leaf outside the model gets one backward's
    # gradient, not two, and the model's gradients are the ranks' mean, not counted twice, also
    # for parameters under reentrant activation checkpointing (their gradients come from a
    # backward inside the checkpoint's).
    outs = ddpkit.launch(own_loop.first_backward, weight, checkpointed, nproc=3)
    for out in (outs[r] for r in range(3)):
        assert out["rebuilt"]
        assert torch.equal(*out["scale"])
        for got, want in zip(*out["params"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_a_first_step_the_loop_ran_itself_leaves_no_later_step_unreduced():
    # DDP laid its buckets out after the loop's own `loss.backward()`: rt.backward has nothing
    # left to settle, and must not run a backward that DDP does not reduce.
    outs = ddpkit.launch(own_loop.first_step_by_hand, nproc=3)
    for r in (1, 2):
        for mine, theirs in zip(outs[r]["grads"] + outs[r]["weights"], outs[0]["grads"] + outs[0]["weights"]):
            assert torch.equal(mine, theirs)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["no_grad", "batchnorm", "second_ddp"])
def test_what_surrounds_the_first_backward_on_three_ranks_is_left_as_one_backward_leaves_it(case):
    # no_grad: a forward under no_grad on one rank neither keeps it from settling (the others
    # would wait for its all-reduce) nor changes what is reduced. batchnorm: checkpointing
    # recomputes it in each pass; its statistics count the step's two forwards, as without
    # settling. second_ddp: another DDP's parameters in the loss: not settled, and that DDP's
    # gradients are still reduced (the ranks' mean: equal on every rank).
    outs = ddpkit.launch(own_loop.first_step_around, case, nproc=3)
    for r in (1, 2):
        for mine, theirs in zip(outs[r]["grads"], outs[0]["grads"]):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert all(out["rebuilt"] for out in outs.values()) == (case != "second_ddp")
    if case == "batchnorm":
        assert all(out["buffers"][-1].item() == 2 for out in outs.values())  # num_batches_tracked


@pytest.mark.distributed
@pytest.mark.slow
def test_a_compiled_model_with_micro_batches_trains_on_three_ranks():
    outs = ddpkit.launch(own_loop.compiled_steps, nproc=3)
    for r in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(outs[r], outs[0]))


@pytest.mark.distributed
def test_a_closed_runtime_keeps_no_model_alive_whose_buckets_it_never_settled():
    assert not any(ddpkit.launch(own_loop.model_kept_after_close, nproc=3).values())


@pytest.mark.distributed
@pytest.mark.slow
def test_a_custom_loop_stopped_mid_epoch_resumes_within_rounding_on_another_n(tmp_path):
    # With dropout: setup() puts ddpkit's in the model, whose masks are keyed by the step and the
    # sample's place in the global batch, not by the rank. A run without dropout ends elsewhere.
    path = str(tmp_path / "state.pt")
    base = ddpkit.launch(own_loop.custom_loop, None, 12, path, dropout=0.3, nproc=2)
    ddpkit.launch(own_loop.custom_loop, 7, 12, path, dropout=0.3, nproc=2)
    for nproc in (1, 3):
        other = ddpkit.launch(own_loop.custom_loop, None, 12, path, resume=True, dropout=0.3, nproc=nproc)
        torch.testing.assert_close(other[0]["params"], base[0]["params"], rtol=0, atol=WORLD_SIZE_ATOL)
        assert other[0]["position"] == base[0]["position"]
    plain = ddpkit.launch(own_loop.custom_loop, None, 12, path + ".plain", nproc=1)
    assert (plain[0]["params"] - base[0]["params"]).abs().max() > 1e-2  # the dropout changed the weights


@pytest.mark.distributed
def test_dropout_ends_the_same_on_1_2_and_3_processes_with_micro_batches():
    # nn.Dropout (replaced by setup()) and ddpkit.dropout in the forward, at one site twice.
    one = own_loop.dropout_loop()
    for nproc, micro in ((2, 2), (3, 1), (3, None)):
        out = ddpkit.launch(own_loop.dropout_loop, micro=micro, nproc=nproc)
        for r in range(nproc):
            torch.testing.assert_close(out[r], one, rtol=0, atol=1e-5)
    # The test can fail: torch's dropout on 2 processes, and no dropout at all, end elsewhere.
    with_torch = ddpkit.launch(own_loop.dropout_loop, invariant=False, nproc=2)
    assert (with_torch[0] - one).abs().max() > 1e-2
    assert (own_loop.dropout_loop(p=0.0) - one).abs().max() > 1e-2


@pytest.mark.distributed
@pytest.mark.slow
def test_a_custom_fsdp_loop_resumes_from_its_sharded_state_on_the_same_and_another_n(tmp_path):
    path = str(tmp_path / "state")
    straight = ddpkit.launch(own_loop.custom_loop, None, 9, path, strategy="fsdp", nproc=2)
    ddpkit.launch(own_loop.custom_loop, 4, 9, path, strategy="fsdp", nproc=2)
    assert os.path.isdir(path)  # DCP shards, every rank its own
    same = ddpkit.launch(own_loop.custom_loop, None, 9, path, resume=True, strategy="fsdp", nproc=2)
    assert same[0]["params"].equal(straight[0]["params"])
    other = ddpkit.launch(own_loop.custom_loop, None, 9, path, resume=True, strategy="fsdp", nproc=3)
    torch.testing.assert_close(other[0]["params"], straight[0]["params"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.distributed
def test_main_first_runs_the_block_on_rank_0_before_the_others(tmp_path):
    seen = ddpkit.launch(own_loop.main_first_order, str(tmp_path), nproc=3)
    assert seen[0] == []
    assert seen[1] == seen[2] == ["downloaded"]
    assert (tmp_path / "downloaded").read_text() == "0"


@pytest.mark.unit
def test_a_dataloader_over_a_stream_is_read_as_one_stream_and_save_state_keeps_its_position(tmp_path):
    from ddpkit.data import StreamLoader

    path = tmp_path / "state.pt"
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model, opt = rt.setup(torch.nn.Linear(6, 3), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        loader = rt.loader(DataLoader(Stream(), batch_size=7))
        assert isinstance(loader, StreamLoader)
        seen = []
        for _, _, ids in loader:
            seen.append(ids.tolist())
            if len(seen) == 2:
                break
        rt.save_state(path)
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model, opt = rt.setup(torch.nn.Linear(6, 3), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        loader = rt.loader(DataLoader(Stream(), batch_size=7))
        rt.load_state(path)
        rest = [ids.tolist() for _, _, ids in loader]
    assert seen + rest == expected(0)  # no batch replayed, none skipped


def two_models_step(weighted: bool) -> torch.Tensor:
    """One step of two models set up in turn (a GAN's, a teacher and student's), stepped by two
    optimizers on one backward, with the loss a per-sample mean weighted by its samples."""
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        a, opt_a = rt.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
        b, opt_b = rt.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
        loss = a(x).pow(2).mean() + b(x).pow(2).mean()
        rt.backward(loss, weight=len(x) if weighted else None)
        assert rt.step(opt_a) and rt.step(opt_b)
        return torch.cat([p.detach().flatten() for m in (a, b) for p in m.parameters()])


@pytest.mark.unit
def test_a_weighted_step_rescales_every_models_gradients():
    # weight = the samples a per-sample mean is over: the update is the unweighted one.
    torch.testing.assert_close(two_models_step(True), two_models_step(False), rtol=0, atol=1e-7)


@pytest.mark.unit
@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -3, "abc", True, torch.ones(4)])
def test_a_weight_that_is_no_count_is_refused_in_one_line(weight):
    with ddpkit.Runtime(device="cpu") as rt:
        model = rt.setup(torch.nn.Linear(2, 1))
        with pytest.raises(UsageError, match=r"weight=") as err:
            rt.backward(model(torch.ones(3, 2)).mean(), weight=weight)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_once_weighted_every_backward_must_be_weighted():
    with ddpkit.Runtime(device="cpu") as rt:
        model = rt.setup(torch.nn.Linear(2, 1))
        rt.backward(model(torch.ones(3, 2)).mean(), weight=3)
        with pytest.raises(UsageError, match="every backward"):
            rt.backward(model(torch.ones(3, 2)).mean())


def logged_run(folder, stop: int | None, resume: bool) -> None:
    """Steps 1..8 of a model stepped by two optimizers on one backward, rt.log at every step,
    log_params first, the full state saved at step 4; `stop` ends the run early (a kill)."""
    path = os.path.join(folder, "state.pt")
    with ddpkit.Runtime(device="cpu", seed=0, log_dir=folder) as rt:
        model = torch.nn.Linear(3, 1)
        model, opt_w, opt_b = rt.setup(
            model, torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)
        )
        rt.log_params(lr=0.1)  # before load_state: must not begin the log anew
        step = rt.load_state(path)["step"] if resume else 0
        x = torch.ones(4, 3)
        while step < 8:
            rt.backward(model(x).pow(2).mean())
            rt.step(opt_w)
            if rt.step(opt_b):
                step += 1
                rt.log(step, loss=float(step))
                if step == 4:
                    rt.save_state(path, step=step)
                if step == stop:
                    return


@pytest.mark.unit
def test_a_resumed_loop_keeps_its_log_up_to_the_restored_step_whatever_was_called_first(tmp_path):
    logged_run(str(tmp_path), stop=6, resume=False)
    logged_run(str(tmp_path), stop=None, resume=True)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))  # none lost, none twice
    assert json.loads((tmp_path / "params.json").read_text()) == {"lr": 0.1}


@pytest.mark.unit
def test_load_state_refuses_what_it_cannot_load_into_this_run_in_one_line(tmp_path):
    plain, full = str(tmp_path / "plain.pt"), str(tmp_path / "full.pt")
    data = TensorDataset(torch.arange(8.0))
    with ddpkit.Runtime(device="cpu") as rt:
        model, opt = rt.setup(torch.nn.Linear(1, 1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
        with pytest.raises(UsageError, match="after rt.setup"):
            ddpkit.Runtime(device="cpu").load_state(full)
        rt.save(plain, model=model, optimizer=opt)
        rt.loader(data, batch_size=4)
        rt.save_state(full)
        with pytest.raises(UsageError, match="not written by rt.save_state"):
            rt.load_state(plain)
        with pytest.raises(UsageError, match="saved without being named"):
            rt.save_state(full, loader=5)
        with pytest.raises(UsageError, match="no entry 'scheduler'"):
            rt.load_state(full, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
        rt.loader(data, batch_size=4)  # a second loader the saved run did not make
        with pytest.raises(
            UsageError, match="holds loader, model, optimizer, precision; this run has loader, loader_1"
        ):
            rt.load_state(full)


@pytest.mark.unit
def test_a_name_mlflow_would_refuse_is_refused_before_anything_is_written(tmp_path):
    with ddpkit.Runtime(device="cpu", log_dir=str(tmp_path), log_with=["mlflow"]) as rt:
        with pytest.raises(UsageError, match="MLflow refuses the name 'a b!'"):
            rt.log(1, **{"a b!": 1.0})
        with pytest.raises(UsageError, match="MLflow refuses the name '../x'"):
            rt.log_params(**{"../x": 1})
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    "call, says",
    [
        (lambda rt, d: rt.eval_loader(d, batch_size=0), "batch_size must be"),
        (lambda rt, d: rt.eval_loader(d, batch_size=-1), "batch_size must be"),
        (lambda rt, d: rt.loader(d, batch_size=2.5), "batch_size must be"),
        (lambda rt, d: rt.loader(d, batch_size=2, collate_fn=3), "collate_fn must be"),
        (lambda rt, d: rt.loader(5, batch_size=2), "not int"),
        (lambda rt, d: rt.evaluate(torch.nn.Linear(1, 1), rt.loader(d, batch_size=2)), "not a training loader"),
        (  # a mapping whose entries have no usual name: evaluate asks for keys=
            lambda rt, d: rt.evaluate(torch.nn.Linear(1, 1), DataLoader(d, batch_size=2, collate_fn=ab_batch)),
            r"a batch that is a mapping \('a', 'b'\) has no input and no target entry; name its input and",
        ),
        (lambda rt, d: rt.evaluate(torch.nn.Linear(1, 1), d, metrics={"m": lambda o, y: 1.0}), "returned float"),
        (lambda rt, d: rt.eval_loader(DataLoader(Stream(), batch_size=4)), "map-style"),
    ],
    ids=[
        "eval-batch-0",
        "eval-batch-negative",
        "batch-float",
        "collate-not-callable",
        "not-a-dataset",
        "evaluate-training-loader",
        "evaluate-dict-batches",
        "metric-not-a-tensor",
        "evaluate-a-stream",
    ],
)
def test_bad_loader_and_evaluation_input_is_one_line(call, says):
    data = TensorDataset(torch.arange(6.0).reshape(6, 1), torch.zeros(6, dtype=torch.long))
    with ddpkit.Runtime(device="cpu") as rt, pytest.raises(UsageError, match=says) as err:
        call(rt, data)
    assert "\n" not in str(err.value)


def ab_batch(samples):
    xs, ys = zip(*samples)
    return {"a": torch.stack(xs), "b": torch.stack(ys)}


def dict_batch(samples):
    xs, ys = zip(*samples)
    return {"x": torch.stack(xs), "y": torch.stack(ys), "names": [f"s{i}" for i in range(len(xs))]}


@pytest.mark.unit
def test_an_empty_share_gets_a_batch_with_nothing_in_it_from_a_collate_of_strings_too():
    from ddpkit.data.loader import _Collate

    data = TensorDataset(torch.arange(6.0).reshape(6, 1), torch.zeros(6, dtype=torch.long))
    empty = _Collate(data, dict_batch)([])
    assert empty["x"].shape == (0, 1) and empty["y"].shape == (0,) and empty["names"] == []


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, says", [({"log_with": 5}, "log_with"), ({"log_dir": 5}, "log_dir")])
def test_a_bad_log_argument_is_named_as_such(kwargs, says):
    with pytest.raises(UsageError, match=f"Runtime\\({says}=") as err:
        ddpkit.Runtime(device="cpu", **kwargs)
    assert "ddp=" not in str(err.value)


def save_where(path: str) -> str:
    with ddpkit.Runtime(device="cpu") as rt:
        rt.setup(torch.nn.Linear(1, 1))
        try:
            rt.save_state(path)
        except UsageError as err:
            return str(err)
        return "saved"


@pytest.mark.distributed
def test_a_checkpoint_path_that_cannot_be_written_fails_every_rank_with_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = ddpkit.launch(save_where, str(tmp_path / "a-file" / "state.pt"), nproc=2)
    assert out[0] == out[1] and "not a directory" in out[0] and "\n" not in out[0]
