"""The input checks every door shares: each rule has one message shape, names what is wrong,
and raises UsageError (exit 2 at the command line)."""

from __future__ import annotations

import math
import os

import pytest

from ddpkit.core import checks
from ddpkit.errors import UsageError

pytestmark = pytest.mark.unit


def test_choice_names_the_value_and_every_choice():
    assert checks.choice("--device", "cpu", ("auto", "cpu", "cuda")) == "cpu"
    with pytest.raises(UsageError) as info:
        checks.choice("--device", "tpu", ("auto", "cpu", "cuda"))
    assert str(info.value) == "--device: unknown value 'tpu'; choose from auto, cpu, cuda"


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf])
def test_positive_refuses_zero_negative_nan_and_infinity(value):
    with pytest.raises(UsageError, match=rf"^--lr must be positive, got {value}$"):
        checks.positive("--lr", value)


def test_ranges():
    assert checks.positive("--lr", 0.1) == 0.1
    assert checks.at_least("--warmup-epochs", 0, 0) == 0
    for bad in (-0.5, math.nan, math.inf):  # inf too: `--weight-decay inf` would train to NaN
        with pytest.raises(UsageError, match=rf"^--warmup-epochs must be >= 0, got {bad}$"):
            checks.at_least("--warmup-epochs", bad, 0)
    assert checks.integer("--seed", 2**32 - 1, 0, 2**32 - 1) == 2**32 - 1
    for bad in (-1, 2**32):
        with pytest.raises(UsageError, match=rf"^--seed must be an integer from 0 to 4294967295, got {bad}$"):
            checks.integer("--seed", bad, 0, 2**32 - 1)
    assert checks.in_range("--momentum", 0.0, 0, 1) == 0.0
    for bad in (1.0, -0.1, math.nan):
        with pytest.raises(UsageError, match=r"^--momentum must be in \[0, 1\), got"):
            checks.in_range("--momentum", bad, 0, 1)


@pytest.mark.parametrize("text", ["3,x", "", "3,0,4", "-1", "3,,4"])
def test_shape_refuses_what_is_not_positive_integers(text):
    with pytest.raises(UsageError, match=rf"^--synthetic-shape must be positive integers like 3,32,32, got '{text}'$"):
        checks.shape("--synthetic-shape", text)


def test_shape_and_int_list():
    assert checks.shape("--synthetic-shape", "3,32,32") == (3, 32, 32)
    assert checks.shape("--synthetic-shape", "10") == (10,)
    assert checks.int_list("--batch-sizes", "64, 256", "64,256") == (64, 256)


def test_output_file_is_checked_without_writing_anything(tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert checks.output_file("--json", str(tmp_path / "new" / "deeper" / "r.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the folders are made when writing
    with pytest.raises(UsageError, match=rf"^--json {tmp_path}: is a directory; give a file name$"):
        checks.output_file("--json", str(tmp_path))
    with pytest.raises(
        UsageError, match=rf"^--plot {tmp_path}/a-file/sub/p.png: {tmp_path}/a-file is not a directory$"
    ):
        checks.output_file("--plot", str(tmp_path / "a-file" / "sub" / "p.png"))
    # a device or a pipe would be replaced by the file written beside it and renamed over it
    # (as root, /dev/null was): refused
    os.mkfifo(tmp_path / "pipe.json")
    with pytest.raises(UsageError, match=r"pipe.json: not a regular file \(a device or a pipe\)"):
        checks.output_file("--json", str(tmp_path / "pipe.json"))
    # and so is a link to one (/dev/stdout is a link): the rename would replace the link itself
    (tmp_path / "link.json").symlink_to(tmp_path / "pipe.json")
    with pytest.raises(UsageError, match=r"link.json: not a regular file \(a device or a pipe\)"):
        checks.output_file("--json", str(tmp_path / "link.json"))
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "to-file.json").symlink_to(tmp_path / "file.json")  # a link to a file, as before
    assert checks.output_file("--json", str(tmp_path / "to-file.json"))


def test_directory_refuses_a_file_at_or_above_it(tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert checks.directory("--data-dir", str(tmp_path / "not-yet"))
    with pytest.raises(UsageError, match=r"^--data-dir .*a-file: not a directory$"):
        checks.directory("--data-dir", str(tmp_path / "a-file"))
    with pytest.raises(UsageError, match=r"^--data-dir .*a-file/sub: .*a-file is not a directory$"):
        checks.directory("--data-dir", str(tmp_path / "a-file" / "sub"))


def test_memory_refuses_more_than_the_machine_has():
    from ddpkit.core.memory import available_mib

    if available_mib() is None:
        pytest.skip("this system does not report available memory")
    checks.memory("a small thing", 2**20, processes=4)
    with pytest.raises(UsageError, match=r"^a huge thing needs about 1,048,576.0 GiB in each of 2 processes; "):
        checks.memory("a huge thing", 2**50, processes=2)


@pytest.mark.unit
@pytest.mark.alone  # timed in milliseconds
def test_a_value_shown_in_a_message_is_bounded_whatever_its_structure():
    import time

    shared = ["lol"]
    for _ in range(60):  # 2**60 leaves once expanded, 61 lists in memory: what an alias bomb or a crafted pickle makes
        shared = [shared, shared]

    class Loud:
        def __repr__(self) -> str:
            return "x" * 10**7

    t = time.perf_counter()
    texts = [
        checks.shown(shared),
        checks.shown(Loud()),
        checks.shown("a" * 10**6),
        checks.shown({i: i for i in range(10**5)}),
    ]
    assert time.perf_counter() - t < 0.5 and all(len(text) <= 80 for text in texts)
    assert texts[0].startswith("[[[") and texts[1] == "<Loud>" and "..." in texts[2]
    assert (checks.shown(3), checks.shown(2.5), checks.shown("epochs"), checks.shown(None)) == (
        "3",
        "2.5",
        "'epochs'",
        "None",
    )
