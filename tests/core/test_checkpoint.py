"""`checkpoint`: files written atomically and read without running code, never loaded when their
bytes no longer match their checksums, a failed write that keeps the previous file, and a
checkpoint saved under DDP that loads into a bare model and back."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import ddpkit
from ddpkit.checkpoint import load_file, save_file
from ddpkit.errors import UsageError
from ddpkit.runtime import Runtime
from tests import workers
from tests.damage import flip, tensor_bytes, zero


class _Payload:
    """Unpickling it would create the file at `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.unit
def test_checkpoint_files_are_atomic_and_safe(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"w": torch.ones(3), "step": 4})
    assert load_file(path)["step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind
    (tmp_path / "bad.pt").write_bytes(path.read_bytes()[:40])
    with pytest.raises(UsageError, match="bad.pt"):
        load_file(tmp_path / "bad.pt")
    marker = tmp_path / "payload-ran"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(UsageError, match="evil.pt"):
        load_file(tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(UsageError, match="no such file"):
        load_file(tmp_path / "missing.pt")


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["flipped", "zeroed", "pickle"])
def test_bytes_that_no_longer_match_their_checksums_are_never_loaded(tmp_path, damage):
    # torch.load itself takes flipped bytes in a tensor for weights: the zip's CRC-32s tell
    path = tmp_path / "c.pt"
    with Runtime("single", device="cpu") as rt:
        model = torch.nn.Linear(256, 64)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        rt.save_state(path)  # a user's own loop's checkpoint
        start, length = tensor_bytes(path)
        if damage == "flipped":
            flip(path, start + length // 2)
            assert torch.load(path, weights_only=True)["model"]["weight"].shape == (64, 256)  # before: loaded
        elif damage == "zeroed":
            zero(path, start + 1000, 4096)
        else:  # the pickle itself: one byte of an entry's name
            flip(path, path.read_bytes().index(b"optimizer"), 1)
        record = r"archive/(data/\d+|data.pkl)"
        with pytest.raises(UsageError, match=rf"c.pt: damaged \({record} does not match the checksum written with it"):
            load_file(path)
        with pytest.raises(UsageError, match=r"c.pt: damaged"):
            rt.load_state(path)  # refused, naming the file


@pytest.mark.unit
def test_failed_write_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "c.pt"
    save_file(path, {"v": 1})

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        save_file(path, {"v": Unsaveable()})
    assert load_file(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.distributed
def test_checkpoint_from_ddp_loads_into_plain_model_and_back(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    saved = ddpkit.launch(workers.save_under_ddp, path, nproc=2)
    assert saved[0]["wrapped"] == "DistributedDataParallel"
    state = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    plain = workers.toy_model(seed=123)
    plain.load_state_dict(state["model"])  # strict: the bare model's own keys
    torch.testing.assert_close(workers.flat_params(plain), saved[0]["params"], rtol=0, atol=0)
    assert "state" in state["optimizer"] and state["note"] == "ddp"
    # ...and back: a plain checkpoint loaded into a DDP-wrapped model on 2 ranks.
    back = ddpkit.launch(workers.load_under_ddp, path, nproc=2)
    for r in back.values():
        assert r["wrapped"] == "DistributedDataParallel" and r["note"] == "ddp"
        torch.testing.assert_close(r["params"], saved[0]["params"], rtol=0, atol=0)


@pytest.mark.unit
def test_a_full_disk_is_an_oserror_naming_the_file_and_the_old_file_stays(tmp_path):
    import errno

    from tests.core.small_disk import small_disk

    with small_disk(tmp_path / "disk", "1m") as disk:
        path = os.path.join(disk, "c.pt")
        save_file(path, {"v": torch.ones(8)})
        with pytest.raises(OSError) as info:
            save_file(path, {"v": torch.ones(1 << 19)})  # 2 MB: torch's own error would be "unexpected pos"
        assert info.value.errno == errno.ENOSPC and info.value.filename == path
        assert torch.equal(load_file(path)["v"], torch.ones(8))
        assert os.listdir(disk) == ["c.pt"]  # the temp file is gone
