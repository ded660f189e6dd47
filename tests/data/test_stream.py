"""`stream`: an IterableDataset read as one global stream. Each rank's micro-batches are the
map-style cut of the stream's global batches (shares, micro-batches, lockstep padding, empty
shares) on any world size; a loader resumed on another world size reads exactly the rest of the
stream, including from a checkpoint taken at an epoch's last step; and real training on 1, 2
and 3 gloo processes (ddp, micro-batches, fsdp) gives plain PyTorch's weights."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit
from ddpkit.data import GlobalBatchSampler, StreamLoader, share
from ddpkit.errors import UsageError
from tests.data import streams
from tests.data.helpers import CPU
from tests.data.streams import EPOCHS, MICRO, STOPS, B, N, Sized, Skippable, Stream, expected, order
from tests.test_runtime import WORLD_SIZE_ATOL
from tests.workers import toy_data


def read(loader: StreamLoader, passes: int = 1) -> list[tuple[int, int, list[int], object]]:
    """(epoch, step, ids, MicroBatch) of every micro-batch of `passes` passes."""
    out = []
    for _ in range(passes):
        for _x, _y, ids in loader:
            info = loader.current
            out.append((loader.epoch, loader.position - info.last, ids.tolist(), info))
    return out


def by_step(entries_per_rank: list[list]) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> the step's ids over all ranks, in rank order."""
    steps: dict[tuple[int, int], list[int]] = {}
    for entries in entries_per_rank:
        for epoch, step, ids, _ in entries:
            steps.setdefault((epoch, step), []).extend(ids)
    return steps


CUTS = [(1, None, False, False), (2, MICRO, False, False), (3, None, False, False), (3, MICRO, True, False)]
CUTS += [(3, MICRO, False, True), (4, 1, True, False)]


@pytest.mark.unit
@pytest.mark.parametrize("world,micro,lockstep,drop_last", CUTS)
def test_each_rank_gets_the_map_style_cut_of_the_streams_global_batches(world, micro, lockstep, drop_last):
    per_rank = []
    for rank in range(world):
        kw = dict(micro_batch_size=micro, lockstep=lockstep, drop_last=drop_last)
        got = read(StreamLoader(Stream(), B, world, rank, CPU, **kw), passes=2)
        want = []
        for epoch in (0, 1):  # the map-style sampler over the same order: the same slices and MicroBatch info
            sampler = GlobalBatchSampler(N, B, world, rank, shuffle=False, **kw)
            want += [(epoch, order(epoch)[a:b], info) for a, b, info in sampler.spans()]
        assert [(e, ids, info) for e, _, ids, info in got] == want
        per_rank.append(got)
    steps = 3 if drop_last else 4
    assert by_step(per_rank) == {(e, k): expected(e)[k] for e in (0, 1) for k in range(steps)}


@pytest.mark.unit
def test_an_empty_share_is_one_empty_micro_batch_shaped_by_the_collate_fn():
    def collate(samples):  # a collate of the user's: a dict
        return {"x": torch.stack([s[0] for s in samples]), "id": torch.tensor([s[2] for s in samples])}

    loader = StreamLoader(Stream(), B, 3, 2, CPU, collate_fn=collate)
    told = []
    loader.on_batch = lambda ld: told.append(ld.current)
    batches = list(loader)
    shares = [(ids, *share(len(ids), 3, 2)) for ids in expected(0)]
    assert [b["id"].tolist() for b in batches] == [ids[off : off + size] for ids, off, size in shares]
    assert batches[-1]["x"].shape == (0, 6) and told[-2].size == 0 and told[-2].last  # 2 samples, 3 ranks
    assert told[-1] is None  # the pass ended: no micro-batch is current


@pytest.mark.unit
@pytest.mark.parametrize("dataset", [Stream, Skippable], ids=["read-and-dropped", "iter_from"])
def test_a_loader_resumed_on_another_world_size_reads_exactly_the_rest_of_the_stream(dataset):
    for before, after, stop in itertools.product((1, 3), (2, 1), range(5)):  # stop 4: the epoch's last step
        live = StreamLoader(dataset(), B, before, 0, CPU)
        for _ in itertools.islice(iter(live), stop):  # one micro-batch per step and rank here
            pass
        state = live.state_dict()
        assert state == {"epoch": 0, "position": stop}
        per_rank, first_pass = [], []
        for rank in range(after):
            resumed = StreamLoader(dataset(), B, after, rank, CPU, micro_batch_size=2)
            resumed.load_state_dict(state)
            first = read(resumed)
            assert (resumed.epoch, resumed.position) == (1, 0)
            per_rank.append(first + read(resumed))
            first_pass.append(first)
            if dataset is Skippable:  # the skipped samples were never read
                assert resumed.dataset.yielded == (N - min(N, stop * B)) + N
        rest = {(0, k): expected(0)[k] for k in range(stop, 4)} | {(1, k): expected(1)[k] for k in range(4)}
        assert by_step(per_rank) == rest, (before, after, stop)
        if stop == 4:  # loaded at the end of epoch 0: the first pass was what was left of it, nothing
            assert first_pass == [[]] * after


@pytest.mark.unit
def test_a_loader_left_after_an_epochs_last_step_goes_on_with_the_next_epoch():
    loader = StreamLoader(Stream(), B, 1, 0, CPU)
    assert len(read(loader)) == 4 and loader.state_dict() == {"epoch": 1, "position": 0}
    for _ in itertools.islice(iter(loader), 4):  # left after epoch 1's last step: its end not read yet
        pass
    assert loader.state_dict() == {"epoch": 1, "position": 4}  # as a map-style loader says there
    assert by_step([read(loader)]) == {(2, k): expected(2)[k] for k in range(4)}  # epoch 2, in this pass
    assert loader.dataset.epochs == [0, 1, 1, 2]  # set_epoch before each pass over the stream


@pytest.mark.unit
def test_length_is_known_only_from_a_dataset_that_has_one():
    unsized = StreamLoader(Stream(), B, 2, 0, CPU)
    assert unsized.steps_per_epoch is None
    with pytest.raises(TypeError, match="a stream has no length: Stream defines no __len__"):
        len(unsized)
    assert len(list(unsized)) == 4  # list() still works (no length hint)
    for drop_last, steps in ((False, 4), (True, 3)):
        sized = StreamLoader(Sized(), B, 2, 1, CPU, micro_batch_size=2, drop_last=drop_last)
        sized.load_state_dict({"epoch": 0, "position": 1})
        assert sized.steps_per_epoch == steps and len(sized) == len(list(sized))


@pytest.mark.unit
def test_an_empty_stream_ends_each_pass_at_once():
    loader = StreamLoader(Stream(n=0), B, 2, 1, CPU)
    assert list(loader) == [] and list(loader) == [] and loader.epoch == 2


@pytest.mark.unit
def test_runtime_loader_reads_an_iterable_dataset_as_a_stream_and_refuses_what_does_not_apply():
    class Plain(IterableDataset):  # no set_epoch, no length: the same stream every epoch
        def __iter__(self):
            return iter(TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5)))

    with ddpkit.Runtime(device="cpu", seed=3) as rt:
        loader = rt.loader(Plain(), batch_size=2)
        assert isinstance(loader, StreamLoader) and loader.on_batch is not None
        assert [y.tolist() for _, y in loader] == [[0, 1], [2, 3], [4]] and loader.epoch == 1
        for option in ({"shuffle": True}, {"seed": 1}, {"num_workers": 2}, {"resident": True}):
            with pytest.raises(UsageError, match=f"^{next(iter(option))}.* does not apply to a stream"):
                rt.loader(Plain(), batch_size=2, **option)
        with pytest.raises(UsageError, match="micro-batch-size"):
            rt.loader(Plain(), batch_size=2, micro_batch_size=0)
        assert rt.loader(toy_data(10), batch_size=2).sampler.shuffle  # map-style: shuffled by default


# -- real gloo processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each world size's runs; each resumes the checkpoint the previous one saved mid-stream:
    1 -> 2 -> 3 -> 1. One launch per world size (one process runs in this one)."""
    ckpt = {w: str(tmp_path_factory.mktemp("stream") / f"stopped-on-{w}.pt") for w in (1, 2, 3)}
    out = {1: {0: streams.stream_runs(ckpt[1], None)}}
    out[2] = ddpkit.launch(streams.stream_runs, ckpt[2], ckpt[1], nproc=2, device="cpu")
    out[3] = ddpkit.launch(streams.stream_runs, ckpt[3], ckpt[2], fsdp=True, nproc=3, device="cpu")
    with ddpkit.Runtime(device="cpu", seed=5) as rt:
        out[1][0]["resumed"] = streams.epoch_loop(rt, MICRO, Skippable(), ckpt[3])
    return out


def steps_of(out: dict, run: str) -> dict[tuple[int, int], list[int]]:
    return by_step([[(e["epoch"], e["step"], e["ids"], None) for e in out[r][run]["log"]] for r in sorted(out)])


def all_steps(start: tuple[int, int] = (0, 0)) -> dict[tuple[int, int], list[int]]:
    steps = {(e, k): expected(e)[k] for e in range(EPOCHS) for k in range(4)}
    return {key: ids for key, ids in steps.items() if key >= start}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_step_on_1_2_and_3_processes_is_the_streams_global_batch(runs, world):
    out = runs[world]
    for run in ("stopped", "whole") + (("fsdp",) if world == 3 else ()):
        assert steps_of(out, run) == all_steps(), run  # also in order: dicts compare keys and ids
        for rank in out:
            log = out[rank][run]["log"]
            keys = [(e["epoch"], e["step"]) for e in log]
            assert keys == sorted(keys)
            for (epoch, step), group in itertools.groupby(log, key=lambda e: (e["epoch"], e["step"])):
                group = list(group)
                batch = len(expected(epoch)[step])
                assert sum(e["size"] for e in group) == share(batch, world, rank)[1]
                assert [e["last"] for e in group] == [False] * (len(group) - 1) + [True]
                assert {e["step_size"] for e in group} == {batch}
                if run != "whole":
                    assert all(e["size"] <= MICRO for e in group)


@pytest.mark.distributed
def test_an_empty_share_and_fsdps_lockstep_on_3_processes(runs):
    out = runs[3]
    last = [e for e in out[2]["whole"]["log"] if e["step"] == 3]  # 2 samples over 3 ranks
    assert [(e["size"], e["shape"], e["last"]) for e in last] == [(0, (0, 6), True)] * EPOCHS

    def micro_batches(run: str, rank: int) -> list[int]:  # per step of epoch 0
        return [sum(1 for e in out[rank][run]["log"] if (e["epoch"], e["step"]) == (0, k)) for k in range(4)]

    assert [micro_batches("stopped", r) for r in range(3)] == [[2, 2, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert [micro_batches("fsdp", r) for r in range(3)] == [[2, 2, 2, 1]] * 3  # padded to the largest share


@pytest.mark.distributed
def test_training_on_the_stream_gives_the_same_weights_on_1_2_and_3_processes(runs):
    reference = streams.plain_reference()
    for world, out in runs.items():
        for run in out[0]:
            for rank in out:
                got = out[rank][run]["params"]
                torch.testing.assert_close(got, reference, rtol=0, atol=WORLD_SIZE_ATOL, msg=f"{world} {run}")
                assert torch.equal(got, out[0][run]["params"])  # replicas (and gathered shards) agree


@pytest.mark.distributed
def test_a_stream_resumed_on_another_world_size_continues_with_no_replay_and_no_skip(runs):
    saved_by = {2: 1, 3: 2, 1: 3}  # who resumed whose checkpoint
    passes = {2: [2, 4, 4], 3: [0, 4, 4], 1: [1, 4]}  # global batches per pass of `for epoch in range(...)`
    for world, out in runs.items():
        stop = STOPS[saved_by[world]]
        start = divmod(stop, 4)
        saved = runs[saved_by[world]][0]["stopped"]["saved"]
        assert saved == {"epoch": start[0] - (start[1] == 0), "position": start[1] or 4}  # 4: epoch 0's end
        assert steps_of(out, "resumed") == all_steps(start)  # the rest of the stream, from the next step
        for rank in out:
            resumed = out[rank]["resumed"]
            assert resumed["passes"] == passes[world]
            assert all(e["loop"] == e["epoch"] for e in resumed["log"])  # each pass is its loop's epoch
        reads = {2: (N - 2 * B) + 2 * N, 3: 3 * N, 1: (N - 3 * B) + N}  # iter_from on 1 and 2 processes
        assert {out[r]["resumed"]["yielded"] for r in out} == {reads[world]}
