"""`datasets`: the digits split is fixed and matches scikit-learn's; `ddpkit train` trains on
MNIST-style files without asking the network and names a corrupted file. (It trains the toy set
in trainer/test_config.py, to accuracy 1.0 on 2 processes, and in cli/test_train.py on one.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit import data
from ddpkit.data import download
from ddpkit.errors import UsageError
from tests.conftest import run_cli
from tests.data.helpers import write_mnist


@pytest.mark.unit
def test_digits_split_is_fixed_and_matches_scikit_learn():
    from sklearn.datasets import load_digits

    splits = data.digits()
    assert (len(splits.train), len(splits.test)) == (1438, 359)
    reference = load_digits()
    x_train, y_train = splits.train.tensors
    assert torch.equal(
        torch.bincount(torch.cat([y_train, splits.test.tensors[1]]), minlength=10),
        torch.bincount(torch.from_numpy(reference.target), minlength=10),
    )
    again = data.digits()  # independent of any seed in force
    torch.manual_seed(123)
    assert torch.equal(again.test.tensors[0], data.digits().test.tensors[0])


@pytest.mark.cli
def test_train_mnist_files_on_two_processes(tmp_path):
    write_mnist(tmp_path / "data" / "mnist", n_train=32, n_test=8)
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--data",
        "mnist",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        "lenet",
        "--epochs",
        "1",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--batch-size",
        "16",
        "--out",
        str(out),
        env={download.MIRROR_ENV: "http://127.0.0.1:9"},
    )  # never asked: the files are there
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["data"] == "mnist" and results["world_size"] == 2 and results["test_samples"] == 8, results


@pytest.mark.cli
def test_train_names_a_corrupted_mnist_file(tmp_path):
    folder = tmp_path / "data" / "mnist"
    write_mnist(folder)
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    proc = run_cli(
        "train",
        "--data",
        "mnist",
        "--data-dir",
        str(tmp_path / "data"),
        "--model",
        "mlp",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "bad"),
    )
    assert proc.returncode == 2 and "t10k-images-idx3-ubyte.gz: corrupted" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_a_new_dataset_is_one_catalogue_entry():
    # What docs/extending.md shows: an entry, nothing else touched, and the library's doors
    # (load, shape_of, train_size, prepare) find it.
    prepared = []
    entry = data.Entry(
        load=lambda name, r: data.Splits(
            TensorDataset(torch.zeros(6, r.seq_len), torch.zeros(6, dtype=torch.long)),
            TensorDataset(torch.zeros(2, r.seq_len), torch.zeros(2, dtype=torch.long)),
            (r.seq_len,),
            2,
        ),
        shape=lambda name, r: ((r.seq_len,), 2),
        prepare=lambda name, r: prepared.append(name),
    )
    data.register("zeros", entry)
    try:
        assert data.shape_of("zeros", seq_len=5) == ((5,), 2)
        assert len(data.load("zeros", seq_len=5).train) == 6 and data.train_size("zeros", seq_len=5) == 6
        data.prepare("zeros")
        assert prepared == ["zeros"]
    finally:
        del data.CATALOGUE["zeros"]
    with pytest.raises(UsageError, match="--data"):
        data.load("zeros")


@pytest.mark.unit
def test_a_registered_dataset_may_read_every_setting_a_built_in_one_would_refuse():
    # docs/extending.md's own dataset reads --seq-len from its Request: ddpkit cannot know which
    # settings a registered dataset reads, so only its built-in ones are held to the rules.
    for setting, refused in (("seq_len", "--data text"), ("num_classes", "--data synthetic")):
        with pytest.raises(UsageError, match=f"applies to {refused} only"):
            data.check_applies("digits", "cnn", False, [setting])
        data.check_applies("my-own-set", "cnn", False, [setting])  # a name register() added
    with pytest.raises(UsageError, match="applies to --model gpt only"):
        data.check_applies("my-own-set", "cnn", False, ["gpt_width"])  # the model's flags still are
