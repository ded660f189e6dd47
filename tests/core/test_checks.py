"""The input checks every door shares: each rule has one message shape, names what is wrong,
and raises UsageError (exit 2 at the command line)."""

from __future__ import annotations

import math

import pytest

from ddpkit import checks
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
    with pytest.raises(UsageError, match=r"^--warmup-epochs must be >= 0, got -0.5$"):
        checks.at_least("--warmup-epochs", -0.5, 0)
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
