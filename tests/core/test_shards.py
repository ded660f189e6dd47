"""`shards`: checkpoint directories (fsdp's, through torch's DCP) read without running code,
and never taken for complete when they are not. One process here; the multi-process writes
and the resumes onto other world sizes are in tests/core/test_strategy.py and
tests/trainer/test_invariance.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from ddpkit import checkpoint
from ddpkit.checkpoint import shards
from ddpkit.errors import UsageError
from ddpkit.trainer import TrainConfig
from ddpkit.trainer.resume import check_resumable, resume_path
from tests.conftest import run_cli
from tests.core.test_checkpoint import _Payload
from tests.damage import flip, zero


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return model, opt


def _save(path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _trained()
    shards.save(path, {"model": model, "optimizer": opt}, model, {"loader": {"position": 3}})
    return model, opt


@pytest.mark.unit
def test_a_directory_round_trip_restores_model_optimizer_and_the_rest(tmp_path):
    model, opt = _save(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", "checksums.json", "state.pt"]
    fresh, fresh_opt = _trained(seed=1)
    rest = checkpoint.load_into(tmp_path / "ck", {"model": fresh, "optimizer": fresh_opt})
    assert rest == {"loader": {"position": 3}}
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    for i, state in saved["state"].items():
        assert all(torch.equal(state[k], loaded["state"][i][k]) for k in state)
    assert loaded["param_groups"][0]["lr"] == 0.01
    # a model of another shape is one line, before DCP reads anything
    with pytest.raises(UsageError, match=r"do not fit this model \(0.weight is \[7, 5\] in the checkpoint, \[9, 5\]"):
        checkpoint.load_into(tmp_path / "ck", {"model": nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 3))})


@pytest.mark.unit
def test_a_planted_metadata_pickle_never_runs(tmp_path):
    _save(tmp_path / "ck")
    marker = tmp_path / "payload-ran"
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    model, opt = _trained()
    with pytest.raises(UsageError, match=r"ck: refused, loading its .metadata would run code \(posix.system\)"):
        checkpoint.load_into(tmp_path / "ck", {"model": model, "optimizer": opt})
    with pytest.raises(UsageError, match="would run code"):
        shards.read_metadata(tmp_path / "ck")
    assert not marker.exists()


@pytest.mark.unit
def test_a_planted_optimizer_entry_never_runs(tmp_path):
    # DCP's metadata is clean, but a non-tensor entry (an optimizer's lr) holds a pickle that runs
    # code: DCP itself would load it with torch.load(weights_only=False).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt = _trained()
    marker = tmp_path / "payload-ran"
    optim_state = get_optimizer_state_dict(model, opt)
    optim_state["param_groups"][0]["lr"] = _Payload(marker)
    dcp.save(
        {"model": get_model_state_dict(model), "optimizer": optim_state}, checkpoint_id=tmp_path / "ck", no_dist=True
    )
    checkpoint.save_file(tmp_path / "ck" / "state.pt", {})
    with pytest.raises(UsageError, match=r"ck: incomplete or damaged \(no checksums.json"):
        checkpoint.load_into(tmp_path / "ck", {"model": model, "optimizer": opt})
    shards.write_checksums(str(tmp_path / "ck"))  # as a hand that plants it could: the entry is refused still
    with pytest.raises(UsageError, match=r"ck: refused, loading it would run code \(.*GLOBAL posix.system"):
        shards.check_values(tmp_path / "ck", shards.read_metadata(tmp_path / "ck"))  # where a resume chooses
    with pytest.raises(UsageError, match=r"ck: refused, loading it would run code \(.*GLOBAL posix.system") as err:
        checkpoint.load_into(tmp_path / "ck", {"model": model, "optimizer": opt})
    assert "weights_only" not in str(err.value)  # torch's advice to load it unsafely is not relayed
    assert not marker.exists()


@pytest.mark.unit
@pytest.mark.parametrize("file", ["__0_0.distcp", "state.pt", ".metadata"])
@pytest.mark.parametrize("damage", ["flipped", "zeroed"])
def test_a_file_that_no_longer_matches_its_checksum_is_never_loaded(tmp_path, file, damage):
    # DCP's shards carry no checksum: the directory's checksums.json, written by rank 0 last
    _save(tmp_path / "ck")
    path = tmp_path / "ck" / file
    at = path.stat().st_size // 2
    flip(path, at, 16) if damage == "flipped" else zero(path, at - 8, 16)
    model, opt = _trained(seed=1)
    with pytest.raises(UsageError, match=r"ck: (state.pt: )?damaged"):
        checkpoint.load_into(tmp_path / "ck", {"model": model, "optimizer": opt})
    if file != ".metadata":
        with pytest.raises(UsageError, match=rf"ck: damaged \({file} does not match the checksum written with it\)"):
            shards.verify(tmp_path / "ck")


@pytest.mark.unit
def test_checksums_that_are_missing_unreadable_or_leave_a_file_out_refuse_the_directory(tmp_path):
    _save(tmp_path / "ck")
    sums = tmp_path / "ck" / "checksums.json"
    whole = sums.read_text()
    shards.verify(tmp_path / "ck")  # intact
    (tmp_path / "ck" / "__1_0.distcp").write_bytes(b"a shard nobody wrote")
    with pytest.raises(UsageError, match=r"damaged \(checksums.json does not list __1_0.distcp\)"):
        shards.verify(tmp_path / "ck")
    (tmp_path / "ck" / "__1_0.distcp").unlink()
    sums.write_text(whole[: len(whole) // 2])
    with pytest.raises(UsageError, match=r"damaged \(checksums.json is not readable\)"):
        shards.verify(tmp_path / "ck")
    sums.unlink()
    with pytest.raises(UsageError, match=r"incomplete or damaged \(no checksums.json"):
        shards.verify(tmp_path / "ck")


@pytest.mark.unit
@pytest.mark.parametrize("target", ["pathlib\nPosixPath", "torch.distributed.checkpoint.metadata\nMetadata"])
def test_metadata_gives_no_state_to_a_class_nor_fields_an_instance_does_not_have(tmp_path, target):
    # pickle's BUILD on an admitted class would rewrite that class in this process (and the workers)
    import pathlib

    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / "ck").mkdir()
    opcodes = b"\x80\x02c" + target.encode() + b"\n"
    if target.endswith("Metadata"):  # an instance: Metadata.__new__(Metadata), then a field it lacks
        opcodes += b")\x81"
    opcodes += b"N}X\x07\x00\x00\x00planted" + b"K\x01s\x86b."  # state (None, {"planted": 1}), BUILD
    (tmp_path / "ck" / ".metadata").write_bytes(opcodes)
    with pytest.raises(UsageError, match=r"refused, loading its .metadata would run code \(state for "):
        shards.read_metadata(tmp_path / "ck")
    assert not hasattr(pathlib.PosixPath, "planted") and not hasattr(Metadata, "planted")


class _Crash(BaseException):
    """A kill at that point: nothing after it runs, no `except Exception` catches it."""


@pytest.mark.unit
@pytest.mark.parametrize("crash", ["before the first rename", "between the renames", "before the old is removed"])
def test_a_crash_at_any_point_of_replacing_a_checkpoint_leaves_it_usable(tmp_path, monkeypatch, crash):
    from ddpkit.core.files import prune_temp_files
    from ddpkit.trainer.resume import checkpoint_names

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    path = folder / "step-00000023"  # the same step saved twice (an epoch's end that is also an every-N step)
    model, opt = _trained()
    shards.save(path, {"model": model, "optimizer": opt}, model, {"loader": {"position": 1}})
    renames, real_rename, real_remove = [], os.rename, shards.remove

    def rename(src, dst):
        if os.path.dirname(os.fspath(dst)) == str(folder):  # _put_in_place's, not DCP's inside the temp directory
            renames.append(dst)
            if (crash, len(renames)) in (("before the first rename", 1), ("between the renames", 2)):
                raise _Crash
        return real_rename(src, dst)

    def remove(where):
        if crash == "before the old is removed" and ".tmp-old-" in os.fspath(where):
            raise _Crash
        return real_remove(where)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shards, "remove", remove)
    with pytest.raises(_Crash):
        shards.save(path, {"model": model, "optimizer": opt}, model, {"loader": {"position": 2}})
    monkeypatch.undo()
    shards.recover_replaced(str(folder))  # what --resume auto does first
    prune_temp_files(folder)  # then the run, holding the folder
    assert checkpoint_names(str(folder)) == ["step-00000023"] and os.listdir(folder) == ["step-00000023"]
    shards.verify(path)  # whole and intact: the old one, or once it was in place, the new one
    rest = checkpoint.load_into(path, {"model": _trained(seed=1)[0]})
    assert rest["loader"]["position"] == (2 if crash == "before the old is removed" else 1)


@pytest.mark.unit
def test_starting_over_where_only_unfinished_writes_are_is_said(tmp_path, capsys):
    out = tmp_path / "out"
    _save(out / "checkpoints" / ".tmp-step-00000007-1a2b3c4d")  # a write a kill interrupted
    cfg = TrainConfig(device="cpu", out=str(out), resume="auto")
    assert resume_path(cfg, (1, 8, 8), 10) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ddpkit train: note: --resume auto: no complete checkpoint in {out / 'checkpoints'}, only 1 unfinished "
        "write(s) (removed): starting from step 0"
    ]


@pytest.mark.unit
def test_a_write_error_is_one_oserror_and_a_full_disk_one_naming_the_checkpoint():
    import errno

    path = "/ckpt/step-00000046"
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = shards._write_error(torn, path, [OSError(errno.ENOSPC, "No space left on device")])
    assert (full.errno, full.filename) == (errno.ENOSPC, path)  # what the trainer's one line is made of
    from torch.distributed.checkpoint.api import CheckpointException

    # the rank whose write did not fail learns of the full disk from DCP's gathered failures
    gathered = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert shards._write_error(gathered, path, []).errno == errno.ENOSPC
    other = shards._write_error(torn, path, [])
    assert other.errno is None and str(other) == f"checkpoint {path}: the write failed: {torn}"


def _rewrite_metadata(folder, change) -> None:
    metadata = shards.read_metadata(folder)
    change(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _claim_terabytes(metadata) -> None:
    metadata.state_dict_metadata["model.0.weight"].size = torch.Size([10**7, 10**6])


def _chunk_outside(metadata) -> None:
    metadata.state_dict_metadata["model.0.weight"].chunks[0].offsets = torch.Size([5, 0])


def _shared_path(metadata) -> None:
    shared = ["x"]
    for _ in range(60):  # a few bytes pickled, 2**60 strings once expanded: a repr of it never ends
        shared = [shared, shared]
    for info in metadata.storage_data.values():
        info.relative_path = shared


def _no_data(metadata) -> None:
    del metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == "model.0.bias")]


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,said",
    [
        (_claim_terabytes, r"model.0.weight claims 40,000,000,000,000 bytes, its data holds [\d,]+"),
        (_chunk_outside, r".metadata has no data for model.0.weight"),
        (_no_data, r".metadata has no data for model.0.bias"),
        (_shared_path, r".metadata names a data file \[\[\[.*\]"),
    ],
)
def test_metadata_that_claims_more_than_its_data_is_refused_from_the_metadata_alone(tmp_path, change, said):
    # found where the checkpoint is chosen, before any allocation of the size it claims
    _save(tmp_path / "ck")
    _rewrite_metadata(tmp_path / "ck", change)
    with pytest.raises(UsageError, match=rf"ck: damaged \({said}\)"):
        shards.read_metadata(tmp_path / "ck")


@pytest.mark.unit
def test_incomplete_truncated_or_misdirected_directories_are_refused(tmp_path):
    _save(tmp_path / "ck")
    shards.read_metadata(tmp_path / "ck")  # intact
    data = tmp_path / "ck" / "__0_0.distcp"
    whole = data.read_bytes()
    data.write_bytes(whole[:-10])
    with pytest.raises(
        UsageError, match=rf"ck: truncated \(__0_0.distcp holds {len(whole) - 10} of {len(whole)} bytes\)"
    ):
        shards.read_metadata(tmp_path / "ck")
    data.unlink()
    with pytest.raises(UsageError, match=r"incomplete \(__0_0.distcp is missing\)"):
        shards.read_metadata(tmp_path / "ck")
    data.write_bytes(whole)
    # metadata naming a file outside the directory: refused before anything is read
    metadata = shards.read_metadata(tmp_path / "ck")
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere"
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UsageError, match=r"names a data file '../elsewhere'"):
        shards.read_metadata(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").unlink()  # a write that never finished: DCP writes it last
    with pytest.raises(UsageError, match=r"incomplete \(no .metadata"):
        shards.read_metadata(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UsageError, match=r"damaged \(.metadata is not readable\)"):
        shards.read_metadata(tmp_path / "ck")


@pytest.mark.unit
def test_resume_never_runs_a_planted_checkpoint_directory(tmp_path):
    """--resume PATH and --resume auto check a directory before any worker starts: one line,
    exit 2 (auto: skipped, and with nothing else usable, exit 2), and the pickle never runs."""
    out = tmp_path / "out"
    planted = out / "checkpoints" / "step-00000007"
    planted.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    with open(planted / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    cfg = TrainConfig(device="cpu", out=str(out), resume="auto")
    with pytest.raises(
        UsageError, match=r"none of the 1 checkpoints .* \(step-00000007: refused, loading its .metadata would run code"
    ):
        resume_path(cfg, (1, 8, 8), 10)
    with pytest.raises(UsageError, match="would run code"):
        check_resumable(str(planted), cfg, (1, 8, 8), 10)
    assert not marker.exists()


@pytest.mark.cli
def test_ddpkit_train_resume_path_refuses_a_planted_directory(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "payload-ran"
    with open(planted / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    proc = run_cli("train", "--device", "cpu", "--out", str(tmp_path / "other"), "--resume", str(planted))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("refused, loading its .metadata would run code (posix.system)")
    assert not marker.exists()
