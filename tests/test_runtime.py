"""`Runtime`, the facade: the same training on 1, 2 and 3 processes (even and uneven splits,
with and without micro-batches, with gradient clipping) equals plain PyTorch on one, and
`--channels-last` trains to the same result."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from tests import workers
from tests.conftest import run_train

# Tolerance for "the same training on another number of processes". The all-reduce adds the
# ranks' gradient sums in another order than one process sums its batch; float32 addition is
# not associative, so each step may differ in the last bit (~6e-8 on weights of order 1).
# Measured: 6e-8 to 9e-8 after 8 momentum-SGD steps. atol 1e-6 allows ~8 ulps, and would
# still catch any real difference in data order or gradient weighting (those are > 1e-3).
WORLD_SIZE_ATOL = 1e-6


SPLITS = {
    "even": (12, None),
    "uneven-over-3": (10, None),
    "accumulate": (12, 2),
    "uneven-and-accumulate": (7, 3),  # fsdp: shares 3/2/2 are 1/1/1 micro-batches; 10 below: 4/3/3 are 2/1/1
    "uneven-and-accumulate-padded": (10, 3),
    "empty-shares": (89, None),  # 90 samples: each epoch ends with a 1-sample batch
}
# fsdp on the splits that stress it: uneven shares, ranks with fewer (padded) micro-batches, empty shares.
CASES = [("ddp", name) for name in SPLITS if name != "uneven-and-accumulate-padded"] + [
    ("fsdp", name) for name in ("uneven-over-3", "uneven-and-accumulate-padded", "empty-shares")
]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy,split", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_same_weights_on_1_2_and_3_processes(strategy, split):
    global_batch, micro = SPLITS[split]
    reference = workers.plain_reference(8, global_batch)  # plain PyTorch, one process, no ddpkit
    one = workers.invariant_steps(8, global_batch, micro, strategy=strategy)  # fsdp on one process: single
    torch.testing.assert_close(one["params"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
    for nproc in (2, 3):
        out = ddpkit.launch(workers.invariant_steps, 8, global_batch, micro, strategy=strategy, nproc=nproc)
        for r in range(nproc):
            assert out[r]["strategy"] == strategy
            torch.testing.assert_close(out[r]["params"], one["params"], rtol=0, atol=WORLD_SIZE_ATOL)
            assert out[r]["position"] == one["position"]


@pytest.mark.unit
def test_step_clips_the_gradient_norm():
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = rt.setup(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        (100.0 * model(torch.ones(8, 4)).sum()).backward()  # a gradient norm far above 0.5
        assert rt.step(opt, max_grad_norm=0.5)
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(
        0.5, rel=1e-5
    )  # lr 1: the step is the gradient


@pytest.mark.unit
def test_a_loader_torch_refuses_is_a_usage_error():
    from torch.utils.data import TensorDataset

    from ddpkit.errors import UsageError

    with ddpkit.Runtime(device="cpu") as rt, pytest.raises(UsageError, match="num_workers"):
        rt.loader(TensorDataset(torch.zeros(8, 2)), batch_size=4, num_workers=-1, resident=False)


def unknown_strategy() -> tuple[str, str, bool]:
    """Build a Runtime with a strategy that does not exist; what was raised, and whether a
    process group was left behind."""
    import torch.distributed as tdist

    try:
        ddpkit.Runtime(strategy="warp", device="cpu")
    except Exception as err:  # noqa: BLE001 - the test checks which one
        return type(err).__name__, str(err), tdist.is_initialized()
    return "nothing", "", tdist.is_initialized()


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_unknown_strategy_is_a_usage_error_naming_it_and_leaves_no_process_group(nproc):
    # It was an AttributeError about '_no_sync', from a close() that ran before that existed.
    out = ddpkit.launch(unknown_strategy, nproc=nproc, device="cpu")
    for kind, message, group_left in out.values():
        assert kind == "UsageError" and "'warp'" in message and "strategy" in message
        assert not group_left


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_clipped_steps_same_on_1_and_2_processes(strategy):
    # DDP clips the all-reduced gradient, the same on every rank: what one process clips.
    # fsdp clips by the norm over all ranks' gradient shards: the same norm.
    reference = workers.plain_reference(8, 12, max_grad_norm=0.05)
    one = workers.invariant_steps(8, 12, max_grad_norm=0.05)
    torch.testing.assert_close(one["params"], reference, rtol=0, atol=WORLD_SIZE_ATOL)
    unclipped = workers.plain_reference(8, 12)
    assert (reference - unclipped).abs().max() > 1e-3  # the norm bound really cut the steps
    out = ddpkit.launch(workers.invariant_steps, 8, 12, None, 90, 0.05, strategy, nproc=2)
    for r in range(2):
        torch.testing.assert_close(out[r]["params"], one["params"], rtol=0, atol=WORLD_SIZE_ATOL)


@pytest.mark.cli
@pytest.mark.slow
def test_channels_last_trains_to_the_same_result(one_epoch_run, tmp_path):
    plain, _, _ = one_epoch_run  # --epochs 1 --nproc 1 (tests/conftest.py)
    plain_w = torch.load(plain / "model.pt", weights_only=True)
    _, nhwc_w, _ = run_train(tmp_path, "nhwc", "--epochs", "1", "--nproc", "1", "--channels-last")
    assert max((plain_w[k] - nhwc_w[k]).abs().max().item() for k in plain_w) < 1e-4
    assert all(not k.startswith("module.") for k in nhwc_w)


@pytest.mark.unit
def test_close_waits_for_a_background_save_and_removes_it_when_it_never_completes(tmp_path, capsys, monkeypatch):
    from concurrent.futures import Future

    from ddpkit.checkpoint.shards import Pending
    from ddpkit.runtime import saves

    partial = tmp_path / ".tmp-ck-1a2b3c4d"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    never = Pending(Future(), str(tmp_path / "ck"), str(partial), None)  # a write that never ends
    done = Future()
    done.set_result(None)
    finished = Pending(done, str(tmp_path / "other"), str(tmp_path / "gone"), None)
    monkeypatch.setattr(saves, "PENDING_WAIT_S", 0.2)
    with ddpkit.Runtime("single", device="cpu") as rt:
        rt._background.track(finished)
        rt._background.track(never)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"ddpkit: checkpoint {tmp_path / 'ck'} is still being written in the background: waiting")
    assert err[1] == f"ddpkit: checkpoint {tmp_path / 'ck'}: not complete after 0.2 s; its partial write removed"
    assert len(err) == 2 and not partial.exists()  # finished or vanished; the completed one said nothing


@pytest.mark.unit
def test_a_runtime_refuses_a_thread_count_that_is_no_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    with pytest.raises(ddpkit.UsageError, match=r"OMP_NUM_THREADS='0': not a positive whole number"):
        ddpkit.Runtime("single", device="cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # set empty: the default, as unset
    with ddpkit.Runtime("single", device="cpu") as rt:
        assert rt.world_size == 1
